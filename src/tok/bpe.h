/*
 * bpe — byte-level BPE over a di_vocab: merges one pre-tokenized piece into token ids, and maps ids
 * back to bytes. Merge order is HF tokenizers' (Word::merge_all): repeatedly apply the applicable
 * merge of lowest rank, leftmost first.
 *
 * Owns: nothing global; a di_bpe_scratch holds per-thread work arrays. Does not: split text
 * (pretok) or recognise added tokens (tokenizer.c).
 * Thread-safety: any thread, one di_bpe_scratch per thread.
 */
#pragma once

#include <stddef.h>
#include <stdint.h>

#include "deepinfer.h" // di_status
#include "tok/vocab.h" // di_vocab

// Growable id array.
typedef struct di_bpe_ids {
    int32_t *ids; // owned
    size_t n;
    size_t cap;
} di_bpe_ids;

di_status di_bpe_ids_push(di_bpe_ids *a, int32_t id);
void di_bpe_ids_deinit(di_bpe_ids *a);

typedef struct di_bpe_scratch {
    int32_t *sym;   // owned [cap]: token id of each live symbol
    int32_t *rank;  // owned [cap]: rank of the merge of (sym[i], sym[i+1]); INT32_MAX if none
    int32_t *next;  // owned [cap] (long pieces: linked list)
    int32_t *prev;  // owned [cap]
    uint64_t *heap; // owned [heap_cap]: (rank << 32 | pos) min-heap entries (long pieces)
    size_t cap;
    size_t heap_cap;
} di_bpe_scratch;

void di_bpe_scratch_init(di_bpe_scratch *s);
void di_bpe_scratch_deinit(di_bpe_scratch *s);

// Appends the ids of one piece (raw bytes; any bytes) to out. DI_ERR_NOMEM.
di_status di_bpe_encode_piece(const di_vocab *v, di_bpe_scratch *s, const char *piece, size_t n,
                              di_bpe_ids *out);
