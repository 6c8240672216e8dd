/* ds4's llama.cpp cross-check helper (built by scripts/llama-cpp-check.sh against a llama.cpp it fetches).
 *
 * usage: llama-logits MODEL.gguf OUT.f32 TOKEN_ID...
 * Loads MODEL on the CPU with f32 KV caches, decodes the token ids as one batch (positions 0..n-1, one sequence)
 * and writes the logits of every position as little-endian f32 [n_tokens, n_vocab] to OUT, the layout of
 * `ds4 logits --out`. Exits non-zero with a message on any failure. */
#include <stdio.h>
#include <stdlib.h>

#include "llama.h"

int main(int argc, char **argv) {
    if (argc < 4) {
        fprintf(stderr, "usage: %s MODEL.gguf OUT.f32 TOKEN_ID...\n", argv[0]);
        return 2;
    }
    const int n = argc - 3;
    llama_backend_init();
    struct llama_model_params mp = llama_model_default_params();
    mp.n_gpu_layers = 0;
    struct llama_model *model = llama_model_load_from_file(argv[1], mp);
    if (!model) {
        fprintf(stderr, "llama.cpp could not load %s\n", argv[1]);
        return 1;
    }
    struct llama_context_params cp = llama_context_default_params();
    cp.n_ctx = n < 256 ? 256 : (uint32_t)n;
    cp.n_batch = cp.n_ctx;
    cp.n_ubatch = cp.n_ctx;
    cp.n_threads = 2;
    cp.n_threads_batch = 2;
    cp.type_k = GGML_TYPE_F32;
    cp.type_v = GGML_TYPE_F32;
    cp.flash_attn_type = LLAMA_FLASH_ATTN_TYPE_DISABLED;
    struct llama_context *ctx = llama_init_from_model(model, cp);
    if (!ctx) {
        fprintf(stderr, "llama.cpp could not create a context\n");
        return 1;
    }
    struct llama_batch batch = llama_batch_init(n, 0, 1);
    for (int i = 0; i < n; i++) {
        char *end = NULL;
        long id = strtol(argv[3 + i], &end, 10);
        if (!end || *end != '\0' || id < 0) {
            fprintf(stderr, "bad token id %s\n", argv[3 + i]);
            return 2;
        }
        batch.token[i] = (llama_token)id;
        batch.pos[i] = i;
        batch.n_seq_id[i] = 1;
        batch.seq_id[i][0] = 0;
        batch.logits[i] = 1;
    }
    batch.n_tokens = n;
    if (llama_decode(ctx, batch) != 0) {
        fprintf(stderr, "llama_decode failed\n");
        return 1;
    }
    const int n_vocab = llama_vocab_n_tokens(llama_model_get_vocab(model));
    FILE *out = fopen(argv[2], "wb");
    if (!out) {
        fprintf(stderr, "cannot write %s\n", argv[2]);
        return 1;
    }
    for (int i = 0; i < n; i++) {
        const float *l = llama_get_logits_ith(ctx, i);
        if (!l || fwrite(l, sizeof(float), (size_t)n_vocab, out) != (size_t)n_vocab) {
            fprintf(stderr, "no logits for position %d\n", i);
            return 1;
        }
    }
    fclose(out);
    llama_batch_free(batch);
    llama_free(ctx);
    llama_model_free(model);
    llama_backend_free();
    return 0;
}
