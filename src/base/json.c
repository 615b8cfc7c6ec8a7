#include "base/json.h"

#include <math.h>

#include "base/log.h"

di_status di_json_load_file(const char *path, json_t **out) {
    json_error_t err;
    json_t *j = json_load_file(path, JSON_REJECT_DUPLICATES, &err);
    if (!j) {
        DI_LOG_ERROR("%s:%d:%d: %s", path, err.line, err.column, err.text);
        return json_error_code(&err) == json_error_cannot_open_file ? DI_ERR_IO : DI_ERR_FORMAT;
    }
    *out = j;
    return DI_OK;
}

bool di_json_get_int(const json_t *obj, const char *key, int64_t *out) {
    const json_t *v = json_object_get(obj, key);
    if (json_is_integer(v)) {
        *out = (int64_t)json_integer_value(v);
        return true;
    }
    if (json_is_real(v)) {
        double d = json_real_value(v);
        if (d == floor(d) && fabs(d) < 9e15) {
            *out = (int64_t)d;
            return true;
        }
    }
    return false;
}

bool di_json_get_num(const json_t *obj, const char *key, double *out) {
    const json_t *v = json_object_get(obj, key);
    if (!json_is_number(v)) return false;
    *out = json_number_value(v);
    return true;
}

bool di_json_get_bool(const json_t *obj, const char *key, bool *out) {
    const json_t *v = json_object_get(obj, key);
    if (!json_is_boolean(v)) return false;
    *out = json_is_true(v);
    return true;
}

const char *di_json_get_str(const json_t *obj, const char *key) {
    const json_t *v = json_object_get(obj, key);
    return json_is_string(v) ? json_string_value(v) : NULL;
}
