#!/usr/bin/env python3
"""Every architecture ggrun runs against llama.cpp, on tiny synthetic models (loaders/synthetic.py's FAMILY_PRESETS:
random weights scaled so that next-token distributions are peaked): llama-perplexity scores
tests/data/ppl_prose.txt and saves its log-probabilities (--kl-divergence-base), then `ggrun perplexity
--kl-divergence` scores the same tokens against them. The table gives, per family and weight type, the mean
KL divergence (and its 99th percentile and maximum), how often both rank the same token first (acceptance:
mean KLD <= 0.005 and same top >= 98%). Perplexities are not shown: a random model's next tokens lie far
below the 16 nats of log-probability the saved file keeps, so the two would not compare.

Speed on a family's real shape is bench_cpu.py's (`--models qwen3-0.6b:q4_k`: loaders/synthetic.py SPEED_PRESETS,
llama-bench and ggrun bench alternating).

`--mutations` also scores wrong formulas (MUTATIONS: files changed for ggrun only) against llama.cpp's base of the
right model, one row each under the model's: what the bars catch.

`--save-data` also writes llama.cpp's top token and log-probabilities at every scored position
(tests/data/families_llama_cpp.json), which tests/llm/test_families.py checks ggrun against without llama.cpp.

llama.cpp's tools come from `bash ../shared/tools/cpu_anchor.sh` (pass its directory with --llama-bin or
$LLAMA_BIN). Where llama-perplexity is not built yet but the build has made libllama.so, `--via-lib` scores
with llama.cpp's library itself through the Python binding that vendors the same commit
(llama-cpp-python 0.3.36's llama_cpp.py): per chunk, the cache cleared, n_ctx tokens decoded in one batch
(flash attention as llama-perplexity's default on the CPU), the scored rows' log-probabilities saved in
the same file format.

    .venv/bin/python scripts/bench/arch_vs_llama.py                       # every family: F32, F16, its shipped type
    .venv/bin/python scripts/bench/arch_vs_llama.py --families qwen3 gemma2 --types F32 --save-data
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

import numpy as np
from gguf.constants import GGMLQuantizationType as QT
from ppl_vs_llama import ggrun_cmd, run  # this folder, beside this script

from ggrun.core.llm.kl_divergence import KLStats, LogProbReader, dequantize_log_probs
from ggrun.loaders.synthetic import FAMILY_PRESETS, drop_biases, family_options, write_tiny_family

ROOT = Path(__file__).resolve().parents[2]

DEFAULT_ANCHOR = Path.home() / ".cache/ggrun-anchor/llama_cpp_python-0.3.36/vendor/llama.cpp/build/bin"
TEXT = ROOT / "tests" / "data" / "ppl_prose.txt"
DATA = ROOT / "tests" / "data" / "families_llama_cpp.json"
N_CTX = 128
_QUIET = None  # llama.cpp's log callback (silent)
SAVED_CHUNKS = 4  # chunks of llama.cpp's log-probabilities kept in the test data (63 positions each)
# The block type each family's files ship in (Q4_K unless named), and the lookup-table types tried on llama too.
SHIPPED = {"gpt-oss": "MXFP4"}
LUT4_ON_LLAMA = ("IQ4_NL", "IQ4_XS", "MXFP4")


def _unit_rope_factors(tensors: dict) -> None:
    for name in [n for n in tensors if n.startswith("rope_factors_") or n == "rope_freqs.weight"]:
        tensors[name] = np.ones_like(tensors[name])


# Wrong formulas, each made by changing the file ggrun reads (not llama.cpp's): ggrun scores the changed model
# against llama.cpp's log-probabilities of the right one (--mutations), to show what the table's bars catch.
# (name, the families or variants it applies to (None: all), the options it changes given the family and the
# model's own options)
MUTATIONS: tuple[tuple[str, tuple[str, ...] | None, Callable[[str, dict], dict]], ...] = (
    ("RoPE base x10", None, lambda arch, o: {"rope_base": 10 * o.get("rope_base", 10000.0)}),
    ("sliding window x2", ("gemma2", "gemma3", "gpt-oss"),
     lambda arch, o: {"sliding_window": 2 * o.get("sliding_window", 16)}),
    ("biases left out", ("qwen2",), lambda arch, o: {"edit": drop_biases}),
    ("one expert a token", ("qwen3moe", "gpt-oss"),
     lambda arch, o: {"extra_metadata": {f"{arch}.expert_used_count": 1}}),
    ("soft-caps x2", ("gemma2",), lambda arch, o: {"extra_metadata": {"gemma2.attn_logit_softcapping": 3.0,
                                                                       "gemma2.final_logit_softcapping": 30.0}}),
    ("RoPE factors ones", ("phi3+longrope_short", "phi3+longrope_long", "llama+rope_freqs"),
     lambda arch, o: {"edit": _unit_rope_factors}),
)


def mutated(fam: str, arch: str, options: dict) -> list[tuple[str, dict]]:
    """The MUTATIONS that apply to a model, each as write_tiny_family's options."""
    return [(name, options | change(arch, options)) for name, where, change in MUTATIONS
            if where is None or fam in where]


def default_types(family: str) -> list[str]:
    """The weight types the table shows for a family when --types is not given."""
    types = ["F32", "F16", SHIPPED.get(family, "Q4_K")]
    return types + [t for t in LUT4_ON_LLAMA if t not in types] if family == "llama" else types


def llama_lib(bin_dir: Path):
    """llama-cpp-python's low-level binding (llama_cpp.py) over the anchor build's libllama.so, imported
    without its package's high-level modules (which need more packages)."""
    import types
    source = bin_dir.parents[3] / "llama_cpp"  # <anchor>/llama_cpp_python-0.3.36/llama_cpp
    os.environ["LLAMA_CPP_LIB_PATH"] = str(bin_dir)
    pkg = types.ModuleType("llama_cpp")
    pkg.__path__ = [str(source)]
    sys.modules.setdefault("llama_cpp", pkg)
    import llama_cpp.llama_cpp as L
    L.llama_backend_init()
    global _QUIET
    _QUIET = L.llama_log_callback(lambda level, text, data: None)  # kept referenced while llama.cpp holds it
    L.llama_log_set(_QUIET, None)
    return L


def lib_base(bin_dir: Path, model: Path, base: Path, chunks: int, threads: int, n_ubatch: int = N_CTX) -> None:
    """llama-perplexity's --kl-divergence-base run done with llama.cpp's library: TEXT tokenized by llama.cpp,
    chunks of N_CTX tokens (the first replaced by BOS where the vocabulary adds one), each decoded from an
    empty cache in one batch, the second half's log-probabilities saved."""
    from ggrun.core.llm.kl_divergence import LogProbWriter
    L = llama_lib(bin_dir)
    m = L.llama_model_load_from_file(str(model).encode(), L.llama_model_default_params())
    if not m:
        raise SystemExit(f"llama.cpp could not load {model}")
    cp = L.llama_context_default_params()
    cp.n_ctx = cp.n_batch = N_CTX
    cp.n_ubatch = n_ubatch
    cp.n_threads = cp.n_threads_batch = threads
    ctx = L.llama_init_from_model(m, cp)
    vocab = L.llama_model_get_vocab(m)
    text = TEXT.read_bytes()
    buf = (L.llama_token * (len(text) + 16))()
    n = L.llama_tokenize(vocab, text, len(text), buf, len(buf), L.llama_vocab_get_add_bos(vocab), False)
    tokens = np.array(buf[:n], dtype=np.int32)
    n_chunks = min(chunks, n // N_CTX)
    n_vocab = L.llama_vocab_n_tokens(vocab)
    first = N_CTX // 2
    writer = LogProbWriter(base, N_CTX, n_vocab, n_chunks, tokens[:n_chunks * N_CTX])
    batch = L.llama_batch_init(N_CTX, 0, 1)
    for c in range(n_chunks):
        L.llama_memory_clear(L.llama_get_memory(ctx), True)
        chunk = tokens[c * N_CTX:(c + 1) * N_CTX].copy()
        if L.llama_vocab_get_add_bos(vocab):
            chunk[0] = L.llama_vocab_bos(vocab)
        for i, t in enumerate(chunk.tolist()):
            batch.token[i], batch.pos[i], batch.n_seq_id[i] = t, i, 1
            batch.seq_id[i][0] = 0
            batch.logits[i] = i >= first
        batch.n_tokens = N_CTX
        if L.llama_decode(ctx, batch) != 0:
            raise SystemExit(f"llama_decode failed on chunk {c}")
        rows = [np.ctypeslib.as_array(L.llama_get_logits_ith(ctx, i), shape=(n_vocab,)).copy()
                for i in range(first, N_CTX - 1)]
        writer.write(np.stack(rows))
    writer.close()
    L.llama_batch_free(batch)
    L.llama_free(ctx)
    L.llama_model_free(m)


def noise_floor(bin_dir: Path, model: Path, base: Path, chunks: int, threads: int) -> tuple[float, float]:
    """Mean KLD and same-top share of llama.cpp against itself: the base run against one in micro-batches of
    16 (other kernel paths, other roundings). What ggrun's figures compare with: a tiny random model magnifies
    last-bit differences, and with 8-bit activation rounding (Q4_K) llama.cpp's own batch size moves it."""
    other = base.with_suffix(".ub16")
    lib_base(bin_dir, model, other, chunks, threads, n_ubatch=16)
    a, b = LogProbReader(base), LogProbReader(other)
    stats = KLStats()
    try:
        for c in range(a.n_chunks):
            targets = a.tokens[c * a.n_ctx + a.n_ctx // 2 + 1:(c + 1) * a.n_ctx]
            stats.add(dequantize_log_probs(b.chunk(c), b.n_vocab), targets, a.chunk(c))
    finally:
        a.close()
        b.close()
    return stats.kld()[0], stats.same_top()[0]


def compare(bin_dir: Path, model: Path, base: Path, chunks: int, threads: int, via_lib: bool = False) -> dict:
    """llama.cpp's log-probabilities saved to `base` (llama-perplexity, or its library with via_lib), then
    ggrun's KL divergence against them."""
    if via_lib:
        lib_base(bin_dir, model, base, chunks, threads)
    else:
        run([str(bin_dir / "llama-perplexity"), "-m", str(model), "-f", str(TEXT), "-c", str(N_CTX), "--chunks",
             str(chunks), "-t", str(threads), "--kl-divergence-base", str(base)])
    return ggrun_kld(model, base, threads)


def ggrun_kld(model: Path, base: Path, threads: int) -> dict:
    """`ggrun perplexity --kl-divergence` of a model against saved log-probabilities."""
    proc = run([*ggrun_cmd(), "perplexity", "-m", str(model), "--kl-divergence-base", str(base), "--kl-divergence",
                "-t", str(threads), "-o", "json"])
    return json.loads(proc.stdout.strip().splitlines()[-1])


def saved_positions(base: Path, n_chunks: int) -> dict:
    """llama.cpp's tokens and, per scored position of the first n_chunks chunks, its top token, that token's
    log-probability and the next token's (from the base file, quantized as llama.cpp saves them)."""
    r = LogProbReader(base)
    try:
        top, top_lp, next_lp = [], [], []
        for i in range(n_chunks):
            lp = dequantize_log_probs(r.chunk(i), r.n_vocab)
            nxt = r.tokens[i * r.n_ctx + r.n_ctx // 2 + 1:(i + 1) * r.n_ctx]
            rows = np.arange(len(nxt))
            top += lp.argmax(axis=1).tolist()
            top_lp += np.round(lp.max(axis=1), 4).tolist()
            next_lp += np.round(lp[rows, nxt], 4).tolist()
        return {"n_ctx": r.n_ctx, "tokens": r.tokens[:n_chunks * r.n_ctx].tolist(), "top": top, "top_logprob": top_lp,
                "next_logprob": next_lp}
    finally:
        r.close()


def save(data: dict, via_lib: bool) -> None:
    """Write llama.cpp's saved positions per model (DATA), with where they came from."""
    producer = "libllama.so through llama_cpp.py" if via_lib else "llama-perplexity"
    DATA.write_text(json.dumps({"producer": f"{producer} (llama.cpp as llama-cpp-python 0.3.36 vendors it), "
                                            "scripts/bench/arch_vs_llama.py",
                                "models": "loaders/synthetic.py FAMILY_PRESETS and FAMILY_VARIANTS",
                                **{k: v for k, v in sorted(data.items()) if "/" in k}}) + "\n")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--llama-bin", default=os.environ.get("LLAMA_BIN", str(DEFAULT_ANCHOR)))
    ap.add_argument("--families", nargs="+", default=list(FAMILY_PRESETS),
                    help="families, or variants of one (loaders/synthetic.py FAMILY_VARIANTS: phi3+longrope_long, ...)")
    ap.add_argument("--types", nargs="+", help="weight types (default: F32, F16 and the family's shipped type; "
                                               "llama also in IQ4_NL, IQ4_XS and MXFP4)")
    ap.add_argument("--chunks", type=int, default=8, help="chunks of -c 128 scored (63 positions each)")
    ap.add_argument("-t", "--threads", type=int, default=2)
    ap.add_argument("--via-lib", action="store_true", help="score with libllama.so (no llama-perplexity needed)")
    ap.add_argument("--noise", action="store_true",
                    help="with --via-lib, add llama.cpp against itself at -ub 16 (its own noise floor)")
    ap.add_argument("--mutations", action="store_true",
                    help="also score changed files (MUTATIONS: wrong formulas) against llama.cpp's base of each model")
    ap.add_argument("--save-data", action="store_true", help=f"write llama.cpp's results to {DATA.relative_to(ROOT)}")
    a = ap.parse_args()
    bin_dir = Path(a.llama_bin)
    if not (bin_dir / ("libllama.so" if a.via_lib else "llama-perplexity")).exists():
        raise SystemExit(f"no llama-perplexity in {bin_dir} (bash ../shared/tools/cpu_anchor.sh builds it)")
    data = json.loads(DATA.read_text()) if a.save_data and DATA.exists() else {}
    noise = a.noise and a.via_lib
    extra = f" {'llama.cpp ub16: KLD':>20} {'same top':>9}" if noise else ""
    print(f"{'family':8} {'type':5} {'mean KLD':>10} {'KLD 99%':>9} {'KLD max':>9} {'same top':>9}  ok{extra}")
    failed = 0
    with tempfile.TemporaryDirectory() as tmp:
        for fam in a.families:
            for type_name in a.types or default_types(fam):
                arch, options = family_options(fam, QT[type_name])
                model = write_tiny_family(Path(tmp) / f"{fam}-{type_name}.gguf", arch, weight_type=QT[type_name],
                                          **options)
                base = Path(tmp) / f"{fam}-{type_name}.kld"
                rec = compare(bin_dir, model, base, a.chunks, a.threads, a.via_lib)
                kld, same = rec["kld"][0], rec["same_top_p"][0]
                ok = kld <= 0.005 and same >= 0.98
                failed += not ok
                floor = ""
                if noise:
                    n_kld, n_same = noise_floor(bin_dir, model, base, a.chunks, a.threads)
                    floor = f"  {n_kld:20.6f} {n_same:9.2%}"
                print(f"{fam:8} {type_name:5} {kld:10.6f} {rec['kld_99']:9.5f} {rec['kld_max']:9.5f} {same:9.2%}  "
                      f"{'yes' if ok else 'NO '}{floor}", flush=True)
                for name, changed in mutated(fam, arch, options) if a.mutations else ():
                    wrong = write_tiny_family(Path(tmp) / "mutated.gguf", arch, weight_type=QT[type_name], **changed)
                    rec = ggrun_kld(wrong, base, a.threads)
                    print(f"  {name:28} {rec['kld'][0]:10.6f} {rec['kld_99']:9.5f} {rec['kld_max']:9.5f} "
                          f"{rec['same_top_p'][0]:9.2%}  {'caught' if rec['kld'][0] > 0.005 else 'MISSED'}", flush=True)
                if a.save_data:  # after each model: a long run interrupted keeps what it measured
                    data[f"{fam}/{type_name}"] = saved_positions(base, min(SAVED_CHUNKS, a.chunks))
                    save(data, a.via_lib)
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
