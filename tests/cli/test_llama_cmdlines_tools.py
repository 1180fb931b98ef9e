"""Command lines from llama.cpp's own documentation for llama-bench, llama-perplexity and llama-parallel,
each parsed by ggrun (the program name swapped for `ggrun bench|perplexity|parallel`) into its settings
record, which must mean what llama.cpp means by it. Nothing is loaded or run.

Sources, in llama.cpp's tree (the commit llama-cpp-python 0.3.36 vendors): tools/llama-bench/README.md,
tools/perplexity/README.md (its --kl-divergence-base / --kl-divergence procedure), the usage in
tools/perplexity/perplexity.cpp's header, examples/training/README.md, ci/run.sh, docs/backend/*.md,
examples/parallel/README.md.
"""
from __future__ import annotations

import shlex

import pytest

from ggrun.cli import cmd_bench, cmd_parallel, cmd_perplexity
from ggrun.cli.cmdline import parse_settings
from ggrun.core.dtypes import DType
from ggrun.core.llm.bench import BenchTest

SETTINGS = {"llama-bench": cmd_bench.settings, "llama-perplexity": cmd_perplexity.settings,
            "llama-parallel": cmd_parallel.settings}


def parse(cmdline: str):
    """The settings record of a llama.cpp command line, read by the ggrun command of the same tool."""
    program, *args = shlex.split(cmdline)
    return parse_settings(SETTINGS[program.rsplit("/", 1)[-1]], args)


def bench_rows(s: cmd_bench.BenchSettings) -> list[tuple]:
    return [(c.model, c.n_batch, c.n_threads, c.n_gpu_layers, c.test.label) for c in s.configs()]


# ---- llama-bench (tools/llama-bench/README.md, docs/backend) --------------------------------------------


def test_bench_text_generation_with_different_models():
    s = parse("./llama-bench -m models/7B/ggml-model-q4_0.gguf -m models/13B/ggml-model-q4_0.gguf -p 0 "
              "-n 128,256,512")
    assert s.models == ("models/7B/ggml-model-q4_0.gguf", "models/13B/ggml-model-q4_0.gguf")
    assert [(c.model.split("/")[1], c.test.label) for c in s.configs()] == \
        [(m, f"tg{n}") for m in ("7B", "13B") for n in (128, 256, 512)]  # the README's six rows, in its order


def test_bench_prompt_processing_with_different_batch_sizes():
    s = parse("./llama-bench -n 0 -p 1024 -b 128,256,512,1024")
    assert [(c.n_batch, c.n_ubatch, c.test) for c in s.configs()] == \
        [(b, 512, BenchTest(1024, 0)) for b in (128, 256, 512, 1024)]  # -ub 512 stays; a run uses min(ub, b)
    assert s.md_columns(device=False) == ("n_threads", "n_batch")  # the README's n_batch column


def test_bench_different_numbers_of_threads():
    s = parse("./llama-bench -n 0 -n 16 -p 64 -t 1,2,4,8,16,32")
    assert s.n_gen == (0, 16) and s.n_prompt == (64,)  # a repeated option appends, as in llama-bench
    assert [(c.n_threads, c.test.label) for c in s.configs()] == \
        [(t, x) for t in (1, 2, 4, 8, 16, 32) for x in ("pp64", "tg16")]


def test_bench_different_numbers_of_gpu_layers():
    s = parse("./llama-bench -ngl 10,20,30,31,32,33,34,35")
    assert s.n_gpu_layers == (10, 20, 30, 31, 32, 33, 34, 35)
    assert [(c.n_gpu_layers, c.test.label) for c in s.configs()] == \
        [(n, x) for n in s.n_gpu_layers for x in ("pp512", "tg128")]


def test_bench_different_prefilled_context():
    s = parse("./llama-bench -d 0,512")
    assert [c.test.label for c in s.configs()] == ["pp512", "tg128", "pp512 @ d512", "tg128 @ d512"]
    assert [c.n_ctx for c in s.configs()] == [512, 128, 1024, 640]


@pytest.mark.parametrize("fmt", ["md", "csv", "json", "jsonl", "sql"])
def test_bench_output_formats(fmt):
    s = parse(f"./llama-bench -o {fmt}")
    assert s.output == fmt
    assert [c.test.label for c in s.configs()] == ["pp512", "tg128"]  # llama-bench's default tests
    assert (s.n_batch, s.n_ubatch, s.repetitions, s.flash_attn) == ((2048,), (512,), 5, (-1,))


def test_bench_flash_attention_on():
    s = parse("llama-bench -m ~/models/Llama-3.2-1B-Instruct-Q4_K_M.gguf -fa 1")
    assert s.models == ("~/models/Llama-3.2-1B-Instruct-Q4_K_M.gguf",) and s.flash_attn == (1,)
    assert "flash_attn" in s.md_columns(device=False)  # a value other than the default gets its column


def test_bench_prompt_and_generation_lengths():
    s = parse("llama-bench -p 128 -n 64 -m Llama-3.2-1B-Instruct-Q4_0.gguf")
    assert [c.test for c in s.configs()] == [BenchTest(128, 0), BenchTest(0, 64)]


def test_bench_list_devices():
    assert parse("./build/bin/llama-bench --list-devices").list_devices


def test_bench_cache_types_and_ranges():
    """llama-bench's usage: -ctk/-ctv lists, ranges 'first-last', 'first-last+step', 'first-last*mult'."""
    s = parse("llama-bench -ctk f16,q8_0 -ctv f16,q8_0 -p 64-512*2 -n 0 -t 1-2 -b 256-512+256")
    assert s.type_k == s.type_v == (DType.F16, DType.Q8_0)
    assert s.n_prompt == (64, 128, 256, 512) and s.n_threads == (1, 2) and s.n_batch == (256, 512)


def test_bench_split_options_as_its_usage_spells_them():
    """llama-bench's usage: -sm <none|layer|row>, -mg <i>, -dev <dev0/dev1/...>, -ts <ts0/ts1/..>, each a
    list (',' or repeated); they nest right after -ngl in its product, and -ts 0 is no split."""
    s = parse("llama-bench -m m.gguf -ngl 99 -sm layer,row -mg 0 -dev CUDA0/CUDA1 -ts 1/1,3/1 -p 16 -n 0")
    assert [(c.split.mode, c.split.tensor_split) for c in s.configs()] == [
        ("layer", (1.0, 1.0)), ("layer", (3.0, 1.0)), ("row", (1.0, 1.0)), ("row", (3.0, 1.0))]
    assert {c.split.devices for c in s.configs()} == {("CUDA0", "CUDA1")}
    d = parse("llama-bench -m m.gguf").configs()[0].split
    assert (d.mode, d.main_gpu, d.devices, d.tensor_split) == ("layer", 0, None, ())
    assert parse("llama-bench -m m.gguf -ts 0 -dev none").configs()[0].split.devices == ()
    assert parse("llama-bench -m m.gguf -ts 0").configs()[0].split.tensor_split == ()


# ---- llama-perplexity ----------------------------------------------------------------------------------


def test_perplexity_of_a_text():
    s = parse("./llama-perplexity -m models/7B/ggml-model-q4_0.bin -f wiki.test.raw")
    assert (s.model, s.file) == ("models/7B/ggml-model-q4_0.bin", "wiki.test.raw")
    assert (s.n_ctx, s.n_batch, s.n_ubatch, s.n_chunks) == (512, 2048, 512, -1)  # llama-perplexity's defaults
    assert not s.kl_divergence and s.kl_divergence_base is None


def test_perplexity_of_a_finetuned_model_fully_offloaded():
    s = parse("./build/bin/llama-perplexity --file wikitext-2-raw/wiki.test.raw -ngl 999 --model finetuned-model.gguf")
    assert (s.model, s.file, s.n_gpu_layers) == ("finetuned-model.gguf", "wikitext-2-raw/wiki.test.raw", 999)


def test_perplexity_as_ci_runs_it():
    s = parse("llama-perplexity --model models/q4_0.gguf -f wiki.test.raw -ngl 99 -c 1024 -b 512 --chunks 2")
    assert (s.n_ctx, s.n_batch, s.n_chunks, s.n_gpu_layers) == (1024, 512, 2, 99)


def test_perplexity_saving_the_base_logits():
    s = parse("llama-perplexity -m models/fp16.gguf -f wiki.test.raw --kl-divergence-base path/to/logit/binary/file.kld")
    assert s.kl_divergence_base == "path/to/logit/binary/file.kld" and s.saves_base and not s.kl_divergence


def test_perplexity_kl_divergence_against_the_base():
    s = parse("llama-perplexity -m models/q4_k_m.gguf --kl-divergence-base path/to/logit/binary/file.kld "
              "--kl-divergence")
    assert s.kl_divergence and not s.saves_base and s.file is None  # the text comes from the base file


def test_perplexity_cache_types_and_flash_attention():
    s = parse("llama-perplexity -m m.gguf -f wiki.test.raw -ctk q8_0 -ctv q8_0 -fa off")
    assert (s.type_k, s.type_v, s.flash_attn) == (DType.Q8_0, DType.Q8_0, False)


def test_perplexity_and_parallel_take_the_split_options():
    """Shared with llama-cli (common/arg.cpp): -dev, -sm, -ts, -mg (lines written here, not copied)."""
    for program in ("llama-perplexity -f t.txt", "llama-parallel"):
        s = parse(f"{program} -m m.gguf -ngl 99 -sm row -ts 3,1 -mg 1 -dev CUDA0,CUDA1")
        assert (s.split.mode, s.split.tensor_split, s.split.main_gpu, s.split.devices) == \
            ("row", (3.0, 1.0), 1, ("CUDA0", "CUDA1"))


# ---- llama-parallel (examples/parallel/README.md) ------------------------------------------------------


def test_parallel_serving_128_requests_with_8_clients():
    s = parse("llama-parallel -m model.gguf -np 8 -ns 128 --top-k 1 -pps --junk 10 -c 16384")
    assert (s.model, s.n_parallel, s.n_sequences, s.n_ctx, s.n_junk) == ("model.gguf", 8, 128, 16384, 10)
    assert s.sampling.top_k == 1 and s.shared_system and s.cont_batching


def test_parallel_defaults_and_continuous_batching_switches():
    s = parse("llama-parallel -m model.gguf")
    assert (s.n_parallel, s.n_sequences, s.n_predict, s.n_ctx, s.n_batch) == (1, 1, 128, 0, 2048)
    assert not s.shared_system and s.n_junk == 1
    assert parse("llama-parallel -m model.gguf -cb").cont_batching
    assert not parse("llama-parallel -m model.gguf -nocb").cont_batching
    assert parse("llama-parallel -m model.gguf -n -1").n_predict == 0  # no limit
