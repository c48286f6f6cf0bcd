// greedy: llama.cpp as a greedy-decoding oracle, written against the public llama.h API only.
//
//   greedy [--print-text] MODEL N PROMPT...
//
// For each PROMPT: clear the KV cache, tokenize the prompt as llama.cpp tokenizes a completion
// prompt (add_special = true, so BOS is prepended only when the vocab says so; parse_special =
// false), decode the whole prompt in one llama_decode (positions 0..P-1), then N times: take the
// raw logits of the last position, pick argmax (ties: the lowest id), record the margin (top-1
// logit minus top-2 logit), and decode that token at the next position. End-of-generation tokens
// do not stop it: exactly N ids are produced. One thread, so the arithmetic is deterministic.
// Prints one JSON line per prompt:
//   {"prompt": "...", "prompt_ids": [...], "ids": [...], "margins": [...]}
// and, with --print-text, "text": the generated ids detokenized (special tokens not rendered).
//
//   greedy --tokenize [--special] MODEL [--file PATH | TEXT]...
//
// Tokenizer oracle (the vocabulary only is loaded): each TEXT, and each file's contents, is
// tokenized as above (add_special = true, parse_special = false), or with --special as a chat
// template's text is (add_special = false: no BOS; parse_special = true: control-token text such
// as <|im_start|> becomes its token). A file is read as bytes with ONE trailing '\n' removed, as
// llama-perplexity's -f reads its text. Prints one JSON line per input:
//   {"text": "...", "ids": [...]}   or   {"file": "PATH", "ids": [...]}
//
// Built by scripts/llama-peer.sh against the static libraries of its llama.cpp build.

#include "llama.h"

#include <algorithm>
#include <cinttypes>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

static void quiet_log(enum ggml_log_level level, const char * text, void * /*user*/) {
    if (level == GGML_LOG_LEVEL_ERROR) {
        fputs(text, stderr);
    }
}

// Length of the valid UTF-8 sequence starting at s[i], or 0 if it is not valid.
static size_t utf8_len(const std::string & s, size_t i) {
    const unsigned char c = (unsigned char) s[i];
    size_t n;
    uint32_t cp;
    if (c < 0x80) return 1;
    else if ((c & 0xE0) == 0xC0) { n = 2; cp = c & 0x1F; }
    else if ((c & 0xF0) == 0xE0) { n = 3; cp = c & 0x0F; }
    else if ((c & 0xF8) == 0xF0) { n = 4; cp = c & 0x07; }
    else return 0;
    if (i + n > s.size()) return 0;
    for (size_t k = 1; k < n; ++k) {
        const unsigned char d = (unsigned char) s[i + k];
        if ((d & 0xC0) != 0x80) return 0;
        cp = (cp << 6) | (d & 0x3F);
    }
    static const uint32_t min_cp[5] = {0, 0, 0x80, 0x800, 0x10000};
    if (cp < min_cp[n] || cp > 0x10FFFF || (cp >= 0xD800 && cp <= 0xDFFF)) return 0;
    return n;
}

// A JSON string literal: quotes, backslashes and control characters escaped, valid UTF-8 kept as
// is, each invalid byte written as U+FFFD.
static std::string json_str(const std::string & s) {
    std::string out = "\"";
    for (size_t i = 0; i < s.size();) {
        const unsigned char c = (unsigned char) s[i];
        const size_t n = utf8_len(s, i);
        if (n == 0) {
            out += "\\ufffd";
            i += 1;
            continue;
        }
        if (n == 1) {
            switch (c) {
                case '"':  out += "\\\""; break;
                case '\\': out += "\\\\"; break;
                case '\n': out += "\\n"; break;
                case '\r': out += "\\r"; break;
                case '\t': out += "\\t"; break;
                default:
                    if (c < 0x20 || c == 0x7F) {
                        char buf[8];
                        snprintf(buf, sizeof(buf), "\\u%04x", c);
                        out += buf;
                    } else {
                        out += (char) c;
                    }
            }
        } else {
            out.append(s, i, n);
        }
        i += n;
    }
    return out + "\"";
}

static std::vector<llama_token> tokenize(const llama_vocab * vocab, const std::string & text,
                                         bool add_special = true, bool parse_special = false) {
    std::vector<llama_token> toks(text.size() + 8);
    int n = llama_tokenize(vocab, text.data(), (int32_t) text.size(), toks.data(), (int32_t) toks.size(),
                           add_special, parse_special);
    if (n < 0) {
        toks.resize(-n);
        n = llama_tokenize(vocab, text.data(), (int32_t) text.size(), toks.data(), (int32_t) toks.size(),
                           add_special, parse_special);
    }
    if (n < 0) {
        fprintf(stderr, "greedy: tokenization failed\n");
        exit(1);
    }
    toks.resize(n);
    return toks;
}

static std::string detokenize(const llama_vocab * vocab, const std::vector<llama_token> & ids) {
    std::string out(ids.size() * 16 + 16, '\0');
    int n = llama_detokenize(vocab, ids.data(), (int32_t) ids.size(), out.data(), (int32_t) out.size(),
                             /*remove_special=*/false, /*unparse_special=*/false);
    if (n < 0) {
        out.resize(-n);
        n = llama_detokenize(vocab, ids.data(), (int32_t) ids.size(), out.data(), (int32_t) out.size(), false, false);
    }
    out.resize(n < 0 ? 0 : n);
    return out;
}

// Decode tokens at positions pos0.., sequence 0, logits only for the last one.
static void decode(llama_context * ctx, const std::vector<llama_token> & toks, int pos0) {
    llama_batch batch = llama_batch_init((int32_t) toks.size(), 0, 1);
    for (size_t i = 0; i < toks.size(); ++i) {
        batch.token[i]     = toks[i];
        batch.pos[i]       = pos0 + (llama_pos) i;
        batch.n_seq_id[i]  = 1;
        batch.seq_id[i][0] = 0;
        batch.logits[i]    = i + 1 == toks.size();
    }
    batch.n_tokens = (int32_t) toks.size();
    const int32_t rc = llama_decode(ctx, batch);
    llama_batch_free(batch);
    if (rc != 0) {
        fprintf(stderr, "greedy: llama_decode failed (%d)\n", rc);
        exit(1);
    }
}

static std::string ids_json(const std::vector<llama_token> & ids) {
    std::string out = "[";
    for (size_t i = 0; i < ids.size(); ++i) {
        out += (i ? ", " : "") + std::to_string(ids[i]);
    }
    return out + "]";
}

// greedy --tokenize [--special] MODEL [--file PATH | TEXT]...
static int tokenize_main(int argc, char ** argv, int a) {
    bool special = false;
    if (a < argc && strcmp(argv[a], "--special") == 0) {
        special = true;
        ++a;
    }
    if (argc - a < 1) {
        fprintf(stderr, "usage: %s --tokenize [--special] MODEL [--file PATH | TEXT]...\n", argv[0]);
        return 2;
    }
    const char * model_path = argv[a++];
    llama_log_set(quiet_log, nullptr);
    llama_backend_init();
    llama_model_params mparams = llama_model_default_params();
    mparams.vocab_only = true;
    llama_model * model = llama_model_load_from_file(model_path, mparams);
    if (!model) {
        fprintf(stderr, "greedy: cannot load %s\n", model_path);
        return 1;
    }
    const llama_vocab * vocab = llama_model_get_vocab(model);
    for (; a < argc; ++a) {
        std::string line;
        if (strcmp(argv[a], "--file") == 0) {
            if (++a >= argc) {
                fprintf(stderr, "greedy: --file needs a path\n");
                return 2;
            }
            std::ifstream f(argv[a], std::ios::binary);
            if (!f) {
                fprintf(stderr, "greedy: cannot read %s\n", argv[a]);
                return 1;
            }
            std::stringstream ss;
            ss << f.rdbuf();
            std::string text = ss.str();
            if (!text.empty() && text.back() == '\n') {
                text.pop_back();
            }
            line = "{\"file\": " + json_str(argv[a]) + ", \"ids\": " + ids_json(tokenize(vocab, text, !special, special)) + "}";
        } else {
            const std::string text = argv[a];
            line = "{\"text\": " + json_str(text) + ", \"ids\": " + ids_json(tokenize(vocab, text, !special, special)) + "}";
        }
        printf("%s\n", line.c_str());
        fflush(stdout);
    }
    llama_model_free(model);
    llama_backend_free();
    return 0;
}

int main(int argc, char ** argv) {
    if (argc > 1 && strcmp(argv[1], "--tokenize") == 0) {
        return tokenize_main(argc, argv, 2);
    }
    bool print_text = false;
    int a = 1;
    if (a < argc && strcmp(argv[a], "--print-text") == 0) {
        print_text = true;
        ++a;
    }
    if (argc - a < 3) {
        fprintf(stderr, "usage: %s [--print-text] MODEL N PROMPT...\n", argv[0]);
        return 2;
    }
    const char * model_path = argv[a++];
    const int n_gen = atoi(argv[a++]);
    if (n_gen <= 0) {
        fprintf(stderr, "greedy: N must be positive\n");
        return 2;
    }
    std::vector<std::string> prompts(argv + a, argv + argc);

    llama_log_set(quiet_log, nullptr);
    llama_backend_init();

    llama_model_params mparams = llama_model_default_params();
    llama_model * model = llama_model_load_from_file(model_path, mparams);
    if (!model) {
        fprintf(stderr, "greedy: cannot load %s\n", model_path);
        return 1;
    }
    const llama_vocab * vocab = llama_model_get_vocab(model);
    const int n_vocab = llama_vocab_n_tokens(vocab);

    std::vector<std::vector<llama_token>> prompt_ids;
    size_t max_prompt = 0;
    for (const auto & p : prompts) {
        prompt_ids.push_back(tokenize(vocab, p));
        if (prompt_ids.back().empty()) {
            fprintf(stderr, "greedy: prompt %s tokenizes to nothing\n", json_str(p).c_str());
            return 1;
        }
        max_prompt = std::max(max_prompt, prompt_ids.back().size());
    }

    llama_context_params cparams = llama_context_default_params();
    // Room for the longest prompt plus N, rounded up; the prompt fits in one batch and one ubatch.
    const uint32_t n_ctx = (uint32_t) ((max_prompt + n_gen + 255) / 256 * 256);
    cparams.n_ctx           = n_ctx;
    cparams.n_batch         = n_ctx;
    cparams.n_ubatch        = n_ctx;
    cparams.n_seq_max       = 1;
    cparams.n_threads       = 1;
    cparams.n_threads_batch = 1;
    cparams.swa_full        = false; // as llama.cpp's tools (common_params) set it
    llama_context * ctx = llama_init_from_model(model, cparams);
    if (!ctx) {
        fprintf(stderr, "greedy: cannot create a context\n");
        return 1;
    }

    for (size_t p = 0; p < prompts.size(); ++p) {
        llama_memory_clear(llama_get_memory(ctx), true);
        const auto & toks = prompt_ids[p];
        decode(ctx, toks, 0);
        int pos = (int) toks.size();

        std::vector<llama_token> ids;
        std::vector<float> margins;
        for (int step = 0; step < n_gen; ++step) {
            const float * logits = llama_get_logits_ith(ctx, -1);
            int best = 0;
            float top1 = logits[0];
            float top2 = -INFINITY;
            for (int v = 1; v < n_vocab; ++v) {
                const float x = logits[v];
                if (x > top1) {          // strict: on a tie the lower id stays
                    top2 = top1;
                    top1 = x;
                    best = v;
                } else if (x > top2) {   // includes x == top1: a tie gives margin 0
                    top2 = x;
                }
            }
            ids.push_back(best);
            margins.push_back(top1 - top2);
            if (step + 1 < n_gen) {
                decode(ctx, {best}, pos++);
            }
        }

        std::string line = "{\"prompt\": " + json_str(prompts[p]) + ", \"prompt_ids\": [";
        for (size_t i = 0; i < toks.size(); ++i) {
            line += (i ? ", " : "") + std::to_string(toks[i]);
        }
        line += "], \"ids\": [";
        for (size_t i = 0; i < ids.size(); ++i) {
            line += (i ? ", " : "") + std::to_string(ids[i]);
        }
        line += "], \"margins\": [";
        for (size_t i = 0; i < margins.size(); ++i) {
            char buf[32];
            snprintf(buf, sizeof(buf), "%s%.6f", i ? ", " : "", margins[i]);
            line += buf;
        }
        line += "]";
        if (print_text) {
            line += ", \"text\": " + json_str(detokenize(vocab, ids));
        }
        line += "}";
        printf("%s\n", line.c_str());
        fflush(stdout);
    }

    llama_free(ctx);
    llama_model_free(model);
    llama_backend_free();
    return 0;
}
