// vocab — loading a Hugging Face tokenizer.json into flat tables (see vocab.h).
#include "tok/vocab.h"

#include <jansson.h>
#include <stdio.h>
#include <string.h>
#include <zlib.h>

#include "base/log.h"
#include "base/mem.h"
#include "base/status.h" // DI_TRY

// ---- reading (optionally gzip-compressed) files ----

static di_status gunzip(const unsigned char *in, size_t n_in, char **out, size_t *n_out) {
    z_stream zs;
    memset(&zs, 0, sizeof zs);
    if (inflateInit2(&zs, 16 + MAX_WBITS) != Z_OK) return DI_ERR_NOMEM;
    size_t cap = n_in * 4 + 1024, len = 0;
    char *buf = di_malloc(cap + 1);
    di_status st = DI_OK;
    if (!buf) {
        st = DI_ERR_NOMEM;
        goto fail;
    }
    zs.next_in = (unsigned char *)in;
    size_t left = n_in;
    for (;;) {
        if (len == cap) {
            size_t ncap = cap * 2;
            char *nb = di_realloc(buf, ncap + 1);
            if (!nb) {
                st = DI_ERR_NOMEM;
                goto fail;
            }
            buf = nb;
            cap = ncap;
        }
        uInt chunk_in = left > (1u << 30) ? (1u << 30) : (uInt)left;
        zs.avail_in = chunk_in;
        size_t room = cap - len;
        zs.avail_out = room > (1u << 30) ? (1u << 30) : (uInt)room;
        zs.next_out = (unsigned char *)buf + len;
        int rc = inflate(&zs, Z_NO_FLUSH);
        left -= chunk_in - zs.avail_in;
        len = (size_t)((char *)zs.next_out - buf);
        if (rc == Z_STREAM_END) break;
        if (rc != Z_OK && !(rc == Z_BUF_ERROR && len == cap)) {
            DI_LOG_ERROR("gzip data is corrupt or truncated (%s)", zs.msg ? zs.msg : "no detail");
            st = DI_ERR_FORMAT;
            goto fail;
        }
    }
    inflateEnd(&zs);
    buf[len] = 0;
    *out = buf;
    *n_out = len;
    return DI_OK;
fail:
    inflateEnd(&zs);
    di_free(buf);
    return st;
}

di_status di_vocab_read_file(const char *path, char **data, size_t *n_bytes) {
    FILE *f = fopen(path, "rb");
    if (!f) {
        DI_LOG_ERROR("%s: cannot open", path);
        return DI_ERR_IO;
    }
    size_t cap = 1 << 20, len = 0;
    char *buf = di_malloc(cap + 1);
    di_status st = DI_OK;
    if (!buf) {
        fclose(f);
        return DI_ERR_NOMEM;
    }
    for (;;) {
        if (len == cap) {
            char *nb = di_realloc(buf, cap * 2 + 1);
            if (!nb) {
                st = DI_ERR_NOMEM;
                goto fail;
            }
            buf = nb;
            cap *= 2;
        }
        size_t got = fread(buf + len, 1, cap - len, f);
        len += got;
        if (got == 0) break;
    }
    if (ferror(f)) {
        DI_LOG_ERROR("%s: read error", path);
        st = DI_ERR_IO;
        goto fail;
    }
    fclose(f);
    f = NULL;
    if (len >= 2 && (unsigned char)buf[0] == 0x1f && (unsigned char)buf[1] == 0x8b) {
        char *plain;
        size_t n_plain;
        st = gunzip((const unsigned char *)buf, len, &plain, &n_plain);
        di_free(buf);
        if (st != DI_OK) {
            DI_LOG_ERROR("%s: cannot decompress", path);
            return st;
        }
        *data = plain;
        *n_bytes = n_plain;
        return DI_OK;
    }
    buf[len] = 0;
    *data = buf;
    *n_bytes = len;
    return DI_OK;
fail:
    if (f) fclose(f);
    di_free(buf);
    return st;
}

// ---- byte-level alphabet (GPT-2 bytes_to_unicode) ----

// Code point that byte b is written as in byte-level token strings.
static uint32_t byte_to_cp(int b) {
    if ((b >= 33 && b <= 126) || (b >= 161 && b <= 172) || (b >= 174 && b <= 255))
        return (uint32_t)b;
    int n = 0;
    for (int c = 0; c < b; c++)
        if (!((c >= 33 && c <= 126) || (c >= 161 && c <= 172) || (c >= 174 && c <= 255))) n++;
    return 256u + (uint32_t)n;
}

// Decodes one UTF-8 code point at s[*i] (input known valid: it came from jansson). -1 on error.
static int32_t utf8_next(const char *s, size_t n, size_t *i) {
    const unsigned char *u = (const unsigned char *)s;
    size_t p = *i;
    if (p >= n) return -1;
    uint32_t c = u[p];
    int extra = c < 0x80 ? 0 : c < 0xE0 ? 1 : c < 0xF0 ? 2 : 3;
    if (c >= 0x80) c &= (0x3F >> extra);
    if (p + (size_t)extra >= n) return -1;
    for (int k = 1; k <= extra; k++) c = (c << 6) | (u[p + k] & 0x3F);
    *i = p + 1 + (size_t)extra;
    return (int32_t)c;
}

// ---- hashing ----

static uint64_t hash_bytes(const char *s, size_t n) {
    uint64_t h = 1469598103934665603ull;
    for (size_t i = 0; i < n; i++) h = (h ^ (unsigned char)s[i]) * 1099511628211ull;
    return h ^ (h >> 29);
}

static size_t pow2_at_least(size_t n) {
    size_t c = 16;
    while (c < n) c <<= 1;
    return c;
}

int32_t di_vocab_find(const di_vocab *v, const char *bytes, size_t n) {
    size_t mask = v->tok_hash_cap - 1;
    for (size_t h = hash_bytes(bytes, n) & mask;; h = (h + 1) & mask) {
        int32_t id = v->tok_hash[h];
        if (id < 0) return -1;
        size_t len = v->tok_off[id + 1] - v->tok_off[id];
        if (len == n && memcmp(v->tok_bytes + v->tok_off[id], bytes, n) == 0) return id;
    }
}

// ---- added-token tries ----

static di_status trie_init(di_vocab_trie *t) {
    memset(t, 0, sizeof *t);
    t->cap = 256;
    t->nodes = di_malloc(sizeof *t->nodes * (size_t)t->cap);
    if (!t->nodes) return DI_ERR_NOMEM;
    t->nodes[0] = (di_vocab_trie_node){.child = -1, .sibling = -1, .token = -1};
    t->n_nodes = 1;
    return DI_OK;
}

static di_status trie_add(di_vocab_trie *t, const char *s, size_t n, int32_t id) {
    int32_t node = 0;
    for (size_t i = 0; i < n; i++) {
        uint8_t b = (uint8_t)s[i];
        int32_t c = t->nodes[node].child;
        while (c >= 0 && t->nodes[c].byte != b) c = t->nodes[c].sibling;
        if (c < 0) {
            if (t->n_nodes == t->cap) {
                di_vocab_trie_node *nn = di_realloc(t->nodes, sizeof *nn * (size_t)t->cap * 2);
                if (!nn) return DI_ERR_NOMEM;
                t->nodes = nn;
                t->cap *= 2;
            }
            c = t->n_nodes++;
            t->nodes[c] = (di_vocab_trie_node){
                .child = -1, .sibling = t->nodes[node].child, .token = -1, .byte = b};
            t->nodes[node].child = c;
        }
        node = c;
    }
    if (n) t->first_byte[(uint8_t)s[0]] = true;
    // A duplicate content keeps the first id, as HF's added vocabulary does.
    if (t->nodes[node].token < 0) t->nodes[node].token = id;
    return DI_OK;
}

int32_t di_vocab_trie_match(const di_vocab_trie *t, const char *text, size_t n, size_t pos,
                            size_t *len) {
    if (!t->nodes || pos >= n || !t->first_byte[(uint8_t)text[pos]]) return -1;
    int32_t node = 0, best = -1;
    for (size_t i = pos; i < n; i++) {
        uint8_t b = (uint8_t)text[i];
        int32_t c = t->nodes[node].child;
        while (c >= 0 && t->nodes[c].byte != b) c = t->nodes[c].sibling;
        if (c < 0) break;
        node = c;
        if (t->nodes[node].token >= 0) {
            best = t->nodes[node].token;
            *len = i + 1 - pos;
        }
    }
    return best;
}

// ---- pre-tokenizer check ----

// True if doc's normalizer, pre_tokenizer and decoder are DeepSeek V3/V4's (the splits pretok.c
// implements): an empty normalizer, three Isolated regex splits with exactly these patterns, then
// ByteLevel without regex; a ByteLevel decoder.
static bool is_deepseek_pipeline(const json_t *doc) {
    static const char *const k_regex[3] = {
        "\\p{N}{1,3}",
        "[\u4e00-\u9fa5\u3040-\u309f\u30a0-\u30ff]+",
        "[!\"#$%&'()*+,\\-./:;<=>?@\\[\\\\\\]^_`{|}~][A-Za-z]+|[^\r\n\\p{L}\\p{P}\\p{S}]?"
        "[\\p{L}\\p{M}]+| ?[\\p{P}\\p{S}]+[\r\n]*|\\s*[\r\n]+|\\s+(?!\\S)|\\s+",
    };
    const json_t *norm = json_object_get(doc, "normalizer");
    if (norm && !json_is_null(norm)) {
        const char *t = json_string_value(json_object_get(norm, "type"));
        const json_t *list = json_object_get(norm, "normalizers");
        if (!t || strcmp(t, "Sequence") != 0 || json_array_size(list) != 0) return false;
    }
    const json_t *pre = json_object_get(doc, "pre_tokenizer");
    const json_t *seq = json_object_get(pre, "pretokenizers");
    const char *pt = json_string_value(json_object_get(pre, "type"));
    if (!pt || strcmp(pt, "Sequence") != 0 || json_array_size(seq) != 4) return false;
    for (size_t i = 0; i < 3; i++) {
        const json_t *e = json_array_get(seq, i);
        const char *t = json_string_value(json_object_get(e, "type"));
        const char *beh = json_string_value(json_object_get(e, "behavior"));
        const char *re = json_string_value(json_object_get(json_object_get(e, "pattern"), "Regex"));
        if (!t || strcmp(t, "Split") || !beh || strcmp(beh, "Isolated") || !re ||
            strcmp(re, k_regex[i]) || json_is_true(json_object_get(e, "invert")))
            return false;
    }
    const json_t *bl = json_array_get(seq, 3);
    const char *bt = json_string_value(json_object_get(bl, "type"));
    if (!bt || strcmp(bt, "ByteLevel") || json_is_true(json_object_get(bl, "add_prefix_space")) ||
        json_is_true(json_object_get(bl, "use_regex")))
        return false;
    const char *dt = json_string_value(json_object_get(json_object_get(doc, "decoder"), "type"));
    return dt && strcmp(dt, "ByteLevel") == 0;
}

// ---- loading ----

void di_vocab_destroy(di_vocab *v) {
    if (!v) return;
    di_free(v->tok_off);
    di_free(v->tok_bytes);
    di_free(v->tok_flags);
    di_free(v->merge_keys);
    di_free(v->merge_rank);
    di_free(v->merge_id);
    di_free(v->tok_hash);
    di_free(v->trie_raw.nodes);
    di_free(v->trie_norm.nodes);
    di_free(v);
}

// Decoded bytes of a byte-level model token string, or false if a character is outside the
// byte-level alphabet.
static bool bytelevel_decode(const char *s, size_t n, const int16_t *cp_to_byte, char *out,
                             size_t *n_out) {
    size_t i = 0, k = 0;
    while (i < n) {
        int32_t c = utf8_next(s, n, &i);
        if (c < 0 || c >= 324 || cp_to_byte[c] < 0) return false;
        out[k++] = (char)cp_to_byte[c];
    }
    *n_out = k;
    return true;
}

typedef struct tok_src {
    const char *s; // borrowed from the JSON document
    size_t n;
    bool added, special, normalized;
} tok_src;

static void hash_insert(di_vocab *v, int32_t id) {
    // Every id is inserted, in id order, so a probe meets equal-byte tokens lowest id first
    // (DeepSeek's file restates ids 0-2 as added tokens).
    size_t mask = v->tok_hash_cap - 1;
    const char *b = v->tok_bytes + v->tok_off[id];
    size_t n = v->tok_off[id + 1] - v->tok_off[id];
    size_t h = hash_bytes(b, n) & mask;
    while (v->tok_hash[h] >= 0) h = (h + 1) & mask;
    v->tok_hash[h] = id;
}

// Like di_vocab_find, restricted to tokens of the BPE model (merges never produce added tokens).
static int32_t find_model(const di_vocab *v, const char *bytes, size_t n) {
    size_t mask = v->tok_hash_cap - 1;
    for (size_t h = hash_bytes(bytes, n) & mask;; h = (h + 1) & mask) {
        int32_t id = v->tok_hash[h];
        if (id < 0) return -1;
        size_t len = v->tok_off[id + 1] - v->tok_off[id];
        if (len == n && !(v->tok_flags[id] & DI_VOCAB_FLAG_ADDED) &&
            memcmp(v->tok_bytes + v->tok_off[id], bytes, n) == 0)
            return id;
    }
}

static di_status merge_insert(di_vocab *v, int32_t a, int32_t b, int32_t rank, int32_t id) {
    uint64_t key = ((uint64_t)(uint32_t)a << 32) | (uint32_t)b;
    size_t mask = v->merge_cap - 1;
    for (size_t h = (size_t)((key * 0x9E3779B97F4A7C15ull) >> 20) & mask;; h = (h + 1) & mask) {
        if (v->merge_keys[h] == key) return DI_OK; // duplicate merge: the first (lowest rank) wins
        if (v->merge_keys[h] == UINT64_MAX) {
            v->merge_keys[h] = key;
            v->merge_rank[h] = rank;
            v->merge_id[h] = id;
            return DI_OK;
        }
    }
}

// Splits a merge entry ("a b" string or ["a", "b"] pair) into its two byte-level strings.
static bool merge_parts(const json_t *m, const char **a, size_t *na, const char **b, size_t *nb) {
    if (json_is_string(m)) {
        const char *s = json_string_value(m);
        size_t n = json_string_length(m);
        const char *sp = memchr(s, ' ', n);
        if (!sp || memchr(sp + 1, ' ', n - (size_t)(sp + 1 - s))) return false;
        *a = s;
        *na = (size_t)(sp - s);
        *b = sp + 1;
        *nb = n - *na - 1;
        return *na > 0 && *nb > 0;
    }
    if (json_is_array(m) && json_array_size(m) == 2 && json_is_string(json_array_get(m, 0)) &&
        json_is_string(json_array_get(m, 1))) {
        *a = json_string_value(json_array_get(m, 0));
        *na = json_string_length(json_array_get(m, 0));
        *b = json_string_value(json_array_get(m, 1));
        *nb = json_string_length(json_array_get(m, 1));
        return *na > 0 && *nb > 0;
    }
    return false;
}

static di_status load_doc(const json_t *doc, di_vocab **out) {
    di_status st = DI_OK;
    di_vocab *v = NULL;
    tok_src *src = NULL;
    char *scratch = NULL;
    const json_t *model = json_object_get(doc, "model");
    const json_t *vocab = json_object_get(model, "vocab");
    const json_t *merges = json_object_get(model, "merges");
    const json_t *added = json_object_get(doc, "added_tokens");
    const char *type = json_string_value(json_object_get(model, "type"));
    if (!json_is_object(model) || !type || strcmp(type, "BPE") != 0 || !json_is_object(vocab) ||
        !json_is_array(merges)) {
        DI_LOG_ERROR("tokenizer.json: model is not a BPE model with vocab and merges");
        return DI_ERR_FORMAT;
    }
    if (added && !json_is_array(added)) {
        DI_LOG_ERROR("tokenizer.json: added_tokens is not an array");
        return DI_ERR_FORMAT;
    }
    if (!is_deepseek_pipeline(doc)) {
        DI_LOG_ERROR("tokenizer.json: normalizer/pre_tokenizer/decoder are not DeepSeek V3/V4's "
                     "(the only pipeline this build implements)");
        return DI_ERR_UNSUPPORTED;
    }
    const json_t *bf = json_object_get(model, "byte_fallback");
    const json_t *dr = json_object_get(model, "dropout");
    if (json_is_true(bf) || (dr && !json_is_null(dr))) {
        DI_LOG_ERROR("tokenizer.json: byte_fallback / dropout BPE is not supported");
        return DI_ERR_FORMAT;
    }

    // id range
    int64_t max_id = -1;
    const char *key;
    json_t *val;
    json_object_foreach((json_t *)vocab, key, val) {
        if (!json_is_integer(val) || json_integer_value(val) < 0 ||
            json_integer_value(val) >= (1 << 24)) {
            DI_LOG_ERROR("tokenizer.json: vocab entry '%s' has a bad id", key);
            return DI_ERR_FORMAT;
        }
        if (json_integer_value(val) > max_id) max_id = json_integer_value(val);
    }
    size_t i_added;
    json_t *a;
    json_array_foreach((json_t *)added, i_added, a) {
        const json_t *idv = json_object_get(a, "id");
        if (!json_is_integer(idv) || json_integer_value(idv) < 0 ||
            json_integer_value(idv) >= (1 << 24) ||
            !json_is_string(json_object_get(a, "content")) ||
            json_string_length(json_object_get(a, "content")) == 0) {
            DI_LOG_ERROR("tokenizer.json: added_tokens[%zu] has a bad id or content", i_added);
            return DI_ERR_FORMAT;
        }
        if (json_integer_value(idv) > max_id) max_id = json_integer_value(idv);
    }
    if (max_id < 255) {
        DI_LOG_ERROR("tokenizer.json: vocabulary too small (%lld ids)", (long long)max_id + 1);
        return DI_ERR_FORMAT;
    }

    v = di_calloc(1, sizeof *v);
    if (!v) return DI_ERR_NOMEM;
    v->n_vocab = (int32_t)max_id + 1;
    v->n_model = (int32_t)json_object_size(vocab);
    src = di_calloc((size_t)v->n_vocab, sizeof *src);
    v->tok_flags = di_calloc((size_t)v->n_vocab, 1);
    v->tok_off = di_calloc((size_t)v->n_vocab + 1, sizeof *v->tok_off);
    if (!src || !v->tok_flags || !v->tok_off) {
        st = DI_ERR_NOMEM;
        goto fail;
    }
    json_object_foreach((json_t *)vocab, key, val) {
        int32_t id = (int32_t)json_integer_value(val);
        if (src[id].s) {
            DI_LOG_ERROR("tokenizer.json: id %d is used twice in the vocab", id);
            st = DI_ERR_FORMAT;
            goto fail;
        }
        src[id] = (tok_src){.s = key, .n = strlen(key)};
    }
    json_array_foreach((json_t *)added, i_added, a) {
        int32_t id = (int32_t)json_integer_value(json_object_get(a, "id"));
        const json_t *c = json_object_get(a, "content");
        // An added token may restate a model token (same id); its content then wins for
        // decoding, as in HF, and it is matched as an added token.
        src[id] = (tok_src){.s = json_string_value(c),
                            .n = json_string_length(c),
                            .added = true,
                            .special = json_is_true(json_object_get(a, "special")),
                            .normalized = json_is_true(json_object_get(a, "normalized"))};
    }

    // byte-level inverse map
    int16_t cp_to_byte[324];
    for (int c = 0; c < 324; c++) cp_to_byte[c] = -1;
    for (int b = 0; b < 256; b++) cp_to_byte[byte_to_cp(b)] = (int16_t)b;

    // decoded bytes of every id
    size_t total = 0;
    for (int32_t id = 0; id < v->n_vocab; id++) total += src[id].n;
    v->tok_bytes = di_malloc(total + 1);
    scratch = di_malloc(total + 1);
    if (!v->tok_bytes || !scratch) {
        st = DI_ERR_NOMEM;
        goto fail;
    }
    size_t off = 0;
    for (int32_t id = 0; id < v->n_vocab; id++) {
        v->tok_off[id] = (uint32_t)off;
        if (!src[id].s) continue;
        v->tok_flags[id] = DI_VOCAB_FLAG_VALID;
        size_t n = 0;
        // HF's ByteLevel decoder maps a token through the byte alphabet when every character is
        // in it, and otherwise passes its UTF-8 through unchanged (added tokens like <｜User｜>).
        if (!bytelevel_decode(src[id].s, src[id].n, cp_to_byte, v->tok_bytes + off, &n)) {
            if (!src[id].added) {
                DI_LOG_ERROR("tokenizer.json: model token %d is not in the byte-level alphabet",
                             id);
                st = DI_ERR_FORMAT;
                goto fail;
            }
            memcpy(v->tok_bytes + off, src[id].s, src[id].n);
            n = src[id].n;
        }
        if (src[id].added) {
            v->tok_flags[id] |= DI_VOCAB_FLAG_ADDED;
            v->n_added++;
        }
        if (src[id].special) v->tok_flags[id] |= DI_VOCAB_FLAG_SPECIAL;
        if (n > v->max_token_bytes) v->max_token_bytes = n;
        off += n;
    }
    v->tok_off[v->n_vocab] = (uint32_t)off;

    v->tok_hash_cap = pow2_at_least((size_t)v->n_vocab * 2);
    v->tok_hash = di_malloc(sizeof *v->tok_hash * v->tok_hash_cap);
    if (!v->tok_hash) {
        st = DI_ERR_NOMEM;
        goto fail;
    }
    memset(v->tok_hash, 0xff, sizeof *v->tok_hash * v->tok_hash_cap);
    for (int32_t id = 0; id < v->n_vocab; id++)
        if (src[id].s) hash_insert(v, id);

    for (int b = 0; b < 256; b++) {
        char c = (char)b;
        // byte tokens must be model tokens (BPE starts from them)
        int32_t id = find_model(v, &c, 1);
        if (id < 0) {
            DI_LOG_ERROR("tokenizer.json: no model token for byte 0x%02x", b);
            st = DI_ERR_FORMAT;
            goto fail;
        }
        v->byte_id[b] = id;
    }

    // merges: every merge's parts and result must be model tokens
    size_t n_merges = json_array_size(merges);
    v->merge_cap = pow2_at_least(n_merges * 2 + 1);
    v->merge_keys = di_malloc(sizeof *v->merge_keys * v->merge_cap);
    v->merge_rank = di_malloc(sizeof *v->merge_rank * v->merge_cap);
    v->merge_id = di_malloc(sizeof *v->merge_id * v->merge_cap);
    if (!v->merge_keys || !v->merge_rank || !v->merge_id) {
        st = DI_ERR_NOMEM;
        goto fail;
    }
    memset(v->merge_keys, 0xff, sizeof *v->merge_keys * v->merge_cap);
    size_t i_merge;
    json_t *m;
    json_array_foreach((json_t *)merges, i_merge, m) {
        const char *sa, *sb;
        size_t na, nb, da, db;
        if (!merge_parts(m, &sa, &na, &sb, &nb) ||
            !bytelevel_decode(sa, na, cp_to_byte, scratch, &da) ||
            !bytelevel_decode(sb, nb, cp_to_byte, scratch + da, &db)) {
            DI_LOG_ERROR("tokenizer.json: merges[%zu] is malformed", i_merge);
            st = DI_ERR_FORMAT;
            goto fail;
        }
        int32_t ia = find_model(v, scratch, da), ib = find_model(v, scratch + da, db);
        int32_t ic = find_model(v, scratch, da + db);
        if (ia < 0 || ib < 0 || ic < 0) {
            DI_LOG_ERROR("tokenizer.json: merges[%zu] names a token that is not in the vocab",
                         i_merge);
            st = DI_ERR_FORMAT;
            goto fail;
        }
        DI_TRY(merge_insert(v, ia, ib, (int32_t)i_merge, ic));
    }
    v->n_merges = (int32_t)n_merges;

    DI_TRY(trie_init(&v->trie_raw));
    DI_TRY(trie_init(&v->trie_norm));
    json_array_foreach((json_t *)added, i_added, a) {
        int32_t id = (int32_t)json_integer_value(json_object_get(a, "id"));
        const json_t *c = json_object_get(a, "content");
        bool norm = json_is_true(json_object_get(a, "normalized"));
        DI_TRY(trie_add(norm ? &v->trie_norm : &v->trie_raw, json_string_value(c),
                        json_string_length(c), id));
    }

    di_free(src);
    di_free(scratch);
    *out = v;
    return DI_OK;
fail:
    di_free(scratch);
    di_free(src);
    di_vocab_destroy(v);
    return st;
}

di_status di_vocab_load_mem(const void *data, size_t n_bytes, di_vocab **out) {
    const unsigned char *u = data;
    char *plain = NULL;
    size_t n_plain = n_bytes;
    const char *text = data;
    di_status st;
    if (n_bytes >= 2 && u[0] == 0x1f && u[1] == 0x8b) {
        if ((st = gunzip(u, n_bytes, &plain, &n_plain)) != DI_OK) return st;
        text = plain;
    }
    json_error_t err;
    json_t *doc = json_loadb(text, n_plain, JSON_ALLOW_NUL, &err);
    di_free(plain);
    if (!doc) {
        DI_LOG_ERROR("tokenizer.json:%d:%d: %s", err.line, err.column, err.text);
        return DI_ERR_FORMAT;
    }
    st = json_is_object(doc) ? load_doc(doc, out) : DI_ERR_FORMAT;
    if (!json_is_object(doc)) DI_LOG_ERROR("tokenizer.json: not a JSON object");
    json_decref(doc);
    return st;
}

di_status di_vocab_load(const char *path, di_vocab **out) {
    char *data;
    size_t n;
    di_status st = di_vocab_read_file(path, &data, &n);
    if (st != DI_OK) return st;
    st = di_vocab_load_mem(data, n, out);
    di_free(data);
    if (st != DI_OK) DI_LOG_ERROR("%s: cannot load tokenizer (%s)", path, di_status_str(st));
    return st;
}
