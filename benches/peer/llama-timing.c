/* ds4's llama.cpp timing helper (built by benches/peer/llama-cpp.sh against the llama.cpp it caches).
 *
 * usage: llama-timing MODEL.gguf N_PROMPT N_GEN THREADS
 * Measures what `llama-bench -p N_PROMPT -n N_GEN -t THREADS` measures, with llama.cpp's default context settings
 * (f16 KV cache, llama-bench's default batch 2048 / micro-batch 512, CPU only): a warm-up decode, then the prompt as one batch (prefill tokens/s,
 * from an empty cache), then N_GEN single-token decodes after the prompt (decode tokens/s; llama-bench's `tg`
 * starts from an empty cache instead, this matches ds4-bench, which decodes after its prefill). Token ids are
 * fixed pseudo-random ids inside the vocabulary. Prints one line: `prefill_tps=X decode_tps=Y`. */
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

#include "llama.h"

static double now_s(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + (double)t.tv_nsec * 1e-9;
}

static int decode(struct llama_context *ctx, struct llama_batch *b, const llama_token *toks, int n, int pos0) {
    b->n_tokens = n;
    for (int i = 0; i < n; i++) {
        b->token[i] = toks[i];
        b->pos[i] = pos0 + i;
        b->n_seq_id[i] = 1;
        b->seq_id[i][0] = 0;
        b->logits[i] = i == n - 1;
    }
    return llama_decode(ctx, *b);
}

int main(int argc, char **argv) {
    if (argc != 5) {
        fprintf(stderr, "usage: %s MODEL.gguf N_PROMPT N_GEN THREADS\n", argv[0]);
        return 2;
    }
    const int n_prompt = atoi(argv[2]), n_gen = atoi(argv[3]), threads = atoi(argv[4]);
    if (n_prompt < 1 || n_gen < 1 || threads < 1) {
        fprintf(stderr, "N_PROMPT, N_GEN and THREADS must be positive\n");
        return 2;
    }
    llama_backend_init();
    struct llama_model_params mp = llama_model_default_params();
    mp.n_gpu_layers = 0;
    struct llama_model *model = llama_model_load_from_file(argv[1], mp);
    if (!model) {
        fprintf(stderr, "llama.cpp could not load %s\n", argv[1]);
        return 1;
    }
    struct llama_context_params cp = llama_context_default_params();
    cp.n_ctx = (uint32_t)(n_prompt + n_gen + 16);
    cp.n_threads = threads;
    cp.n_threads_batch = threads;
    struct llama_context *ctx = llama_init_from_model(model, cp);
    if (!ctx) {
        fprintf(stderr, "llama.cpp could not create a context\n");
        return 1;
    }
    const int n_vocab = llama_vocab_n_tokens(llama_model_get_vocab(model));
    const int n = n_prompt + n_gen;
    llama_token *toks = malloc(sizeof(llama_token) * (size_t)n);
    for (int i = 0; i < n; i++) toks[i] = (llama_token)((i * 7919 + 13) % (n_vocab - 2) + 2);
    struct llama_batch b = llama_batch_init(n_prompt, 0, 1);
    llama_memory_t mem = llama_get_memory(ctx);
    /* Warm-up (as llama-bench does): one short decode, then an empty cache. */
    if (decode(ctx, &b, toks, n_prompt < 16 ? n_prompt : 16, 0) != 0) {
        fprintf(stderr, "llama_decode failed\n");
        return 1;
    }
    llama_synchronize(ctx);
    llama_memory_clear(mem, true);
    double t0 = now_s();
    for (int done = 0; done < n_prompt;) {
        int step = n_prompt - done;
        if (step > (int)cp.n_batch) step = (int)cp.n_batch;
        if (decode(ctx, &b, toks + done, step, done) != 0) {
            fprintf(stderr, "llama_decode failed (prompt)\n");
            return 1;
        }
        done += step;
    }
    llama_synchronize(ctx);
    double t1 = now_s();
    for (int i = 0; i < n_gen; i++) {
        if (decode(ctx, &b, toks + n_prompt + i, 1, n_prompt + i) != 0) {
            fprintf(stderr, "llama_decode failed (decode)\n");
            return 1;
        }
        llama_synchronize(ctx);
    }
    double t2 = now_s();
    printf("prefill_tps=%.3f decode_tps=%.3f\n", n_prompt / (t1 - t0), n_gen / (t2 - t1));
    free(toks);
    llama_batch_free(b);
    llama_free(ctx);
    llama_model_free(model);
    llama_backend_free();
    return 0;
}
