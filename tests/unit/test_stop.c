// stop strings: matches across token boundaries, held-back bytes released on a false alarm,
// the earliest of several strings wins, flush releases what is held.
#include "harness.h"

#include "sample/stop.h"

// Pushes tokens; returns the index of the token that stopped (-1) and the released text.
static int feed(di_stop *s, const char *const *toks, int n, char *text) {
    size_t len = 0;
    for (int i = 0; i < n; i++) {
        const char *out;
        size_t n_out;
        bool hit = di_stop_push(s, toks[i], strlen(toks[i]), &out, &n_out);
        memcpy(text + len, out, n_out);
        len += n_out;
        text[len] = 0;
        if (hit) return i;
    }
    const char *out;
    size_t n_out;
    di_stop_flush(s, &out, &n_out);
    memcpy(text + len, out, n_out);
    text[len + n_out] = 0;
    return -1;
}

static void test_across_tokens(void) {
    const char *stops[] = {"STOP"};
    di_stop s;
    CHECK_EQ(di_stop_init(&s, stops, 1), DI_OK);
    const char *toks[] = {"ab S", "TO", "P tail", "more"};
    char text[256];
    CHECK_EQ(feed(&s, toks, 4, text), 2);
    CHECK_STR_EQ(text, "ab ");
    di_stop_deinit(&s);
}

static void test_false_alarm_released(void) {
    const char *stops[] = {"STOP"};
    di_stop s;
    CHECK_EQ(di_stop_init(&s, stops, 1), DI_OK);
    const char *out;
    size_t n;
    CHECK(!di_stop_push(&s, "xS", 2, &out, &n));
    CHECK_EQ(n, 1); // "S" held back
    CHECK(!di_stop_push(&s, "T", 1, &out, &n));
    CHECK_EQ(n, 0);
    CHECK(!di_stop_push(&s, "x", 1, &out, &n));
    CHECK(n == 3 && memcmp(out, "STx", 3) == 0);
    const char *toks[] = {"ST", "OX", "end S"};
    char text[256];
    CHECK_EQ(feed(&s, toks, 3, text), -1);
    CHECK_STR_EQ(text, "STOXend S"); // flush releases the held "S"
    di_stop_deinit(&s);
}

static void test_earliest_and_inside_token(void) {
    const char *stops[] = {"world", "lo w"};
    di_stop s;
    CHECK_EQ(di_stop_init(&s, stops, 2), DI_OK);
    const char *toks[] = {"hello world"};
    char text[256];
    CHECK_EQ(feed(&s, toks, 1, text), 0);
    CHECK_STR_EQ(text, "hel");
    di_stop_deinit(&s);
    // No stop strings: pass-through.
    CHECK_EQ(di_stop_init(&s, NULL, 0), DI_OK);
    const char *t2[] = {"a", "b"};
    CHECK_EQ(feed(&s, t2, 2, text), -1);
    CHECK_STR_EQ(text, "ab");
    di_stop_deinit(&s);
    const char *bad[] = {""};
    CHECK_EQ(di_stop_init(&s, bad, 1), DI_ERR_INVALID);
}

int main(void) {
    RUN(test_across_tokens);
    RUN(test_false_alarm_released);
    RUN(test_earliest_and_inside_token);
    return test_finish();
}
