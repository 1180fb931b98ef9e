"""llama.cpp's one-line model description (llama_model_desc), which llama-bench prints as the model:
the architecture, llama.cpp's size class for it, and the file type named from `general.file_type`
(e.g. "gemma3 270M Q4_K - Medium"). Without `general.file_type` llama.cpp guesses the file type from
the tensor type most tensors have and says "(guessed)"; so does this.
"""
from __future__ import annotations

from ggrun.loaders.gguf_file import GGUFFile

# llama_ftype -> name (src/llama-model-loader.cpp, llama_ftype_name)
FILE_TYPES = {
    0: "all F32", 1: "F16", 2: "Q4_0", 3: "Q4_1", 7: "Q8_0", 8: "Q5_0", 9: "Q5_1", 10: "Q2_K - Medium",
    11: "Q3_K - Small", 12: "Q3_K - Medium", 13: "Q3_K - Large", 14: "Q4_K - Small", 15: "Q4_K - Medium",
    16: "Q5_K - Small", 17: "Q5_K - Medium", 18: "Q6_K", 19: "IQ2_XXS - 2.0625 bpw", 20: "IQ2_XS - 2.3125 bpw",
    21: "Q2_K - Small", 22: "IQ3_XS - 3.3 bpw", 23: "IQ3_XXS - 3.0625 bpw", 24: "IQ1_S - 1.5625 bpw",
    25: "IQ4_NL - 4.5 bpw", 26: "IQ3_S - 3.4375 bpw", 27: "IQ3_S mix - 3.66 bpw", 28: "IQ2_S - 2.5 bpw",
    29: "IQ2_M - 2.7 bpw", 30: "IQ4_XS - 4.25 bpw", 31: "IQ1_M - 1.75 bpw", 32: "BF16",
    36: "TQ1_0 - 1.69 bpw ternary", 37: "TQ2_0 - 2.06 bpw ternary", 38: "MXFP4 MoE", 39: "NVFP4", 40: "Q1_0",
    41: "Q2_0",
}

# the file type llama.cpp guesses from the most common tensor type (llama_model_loader's constructor)
GUESSED_FILE_TYPE = {
    "F32": 0, "F16": 1, "BF16": 32, "Q4_0": 2, "Q4_1": 3, "Q5_0": 8, "Q5_1": 9, "Q8_0": 7, "Q2_K": 10, "Q3_K": 12,
    "Q4_K": 15, "Q5_K": 17, "Q6_K": 18, "TQ1_0": 36, "TQ2_0": 37, "IQ2_XXS": 19, "IQ2_XS": 20, "IQ2_S": 28,
    "IQ3_XXS": 23, "IQ1_S": 24, "IQ1_M": 31, "IQ4_NL": 25, "IQ4_XS": 30, "IQ3_S": 26,
}

# llama.cpp's size class by layer count, for the architectures ggrun runs (src/models/<arch>.cpp)
SIZE_BY_LAYERS = {
    "llama": {16: "1B", 22: "1B", 26: "3B", 28: "3B", 30: "256M", 36: "8B", 40: "13B", 48: "34B", 60: "30B"},
    "gemma3": {18: "270M", 26: "1B", 32: "8B", 34: "4B", 48: "12B", 62: "27B"},
}


def file_type_name(gf: GGUFFile) -> str:
    """`general.file_type` as llama.cpp names it, or its guess from the tensors, marked "(guessed)"."""
    ft = gf.get("general.file_type")
    if ft is not None:
        return FILE_TYPES.get(int(ft), "unknown, may not work")
    counts: dict[str, int] = {}
    most, best = 0, "F32"
    for info in gf.tensors.values():
        name = info.qtype.name
        counts[name] = counts.get(name, 0) + 1
        if counts[name] > most:
            most, best = counts[name], name
    return "(guessed) " + FILE_TYPES[GUESSED_FILE_TYPE.get(best, 0)]


def size_class(arch: str, n_layer: int, n_vocab: int, n_head: int, n_head_kv: int) -> str:
    """llama.cpp's model type name (LLM_TYPE_*) for the architecture and layer count; '?B' when unknown."""
    if arch == "llama":
        if n_layer == 32:
            return "3B" if n_vocab == 49152 else "7B" if n_vocab < 40000 else "8B"
        if n_layer == 80:
            return "65B" if n_head == n_head_kv else "70B"
    return SIZE_BY_LAYERS.get(arch, {}).get(n_layer, "?B")


def model_description(gf: GGUFFile, n_layer: int, n_vocab: int, n_head: int, n_head_kv: int) -> str:
    """llama_model_desc: e.g. 'llama 256M Q4_1' for SmolLM2-135M, 'gemma3 270M Q4_K - Medium'."""
    return f"{gf.arch} {size_class(gf.arch, n_layer, n_vocab, n_head, n_head_kv)} {file_type_name(gf)}"
