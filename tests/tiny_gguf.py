"""Write a tiny llama-architecture GGUF model with random weights, for tests that run a real
llama.cpp ``llama-server`` (scripts/ensure-llama-server.sh builds one) behind crosstalk.

Why: no model can be downloaded here, and the tests need an engine that speaks the real
wire format (its JSON, SSE framing, usage and timings, headers), not a meaningful model.
The file is about 0.5 MB: 2 layers, width 64, 4 heads, context 512, float32.

The vocabulary is a GPT-2 byte-level BPE one: the 256 byte tokens in GPT-2's
byte-to-unicode form (so any text tokenizes), a few merges, and the ChatML special tokens,
with a ChatML ``tokenizer.chat_template`` so ``/v1/chat/completions`` works.

The output projection's rows for every token that is not plain printable ASCII (control
and high bytes, special tokens, eos) are zero, so those tokens' logits are exactly 0 while
the printable ones are random around 0: greedy decoding and the server's default top-k
never pick them, so the text is printable and runs to ``max_tokens`` without stopping at
eos. Temperature 0 (or a fixed ``seed``) makes a response repeatable for a given file.
"""

from __future__ import annotations

import pathlib
import string
from dataclasses import dataclass

import gguf
import numpy as np

ARCH = "llama"

BOS = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
SPECIAL_TOKENS = (BOS, IM_START, IM_END)

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

# Pairs merged by the BPE tokenizer, in priority order (" " is written as GPT-2's "Ġ").
MERGES = (
    ("Ġ", "t"),
    ("h", "e"),
    ("Ġ", "a"),
    ("i", "n"),
    ("e", "r"),
    ("o", "n"),
    ("Ġt", "he"),
    ("r", "e"),
    ("a", "t"),
    ("e", "n"),
    ("Ġ", "s"),
    ("o", "r"),
)

# Bytes whose tokens may be generated: letters, digits, space and plain punctuation.
PRINTABLE = frozenset((string.ascii_letters + string.digits + " .,;:!?'-()").encode())


# Standard deviation of the random weights. At 1.0 greedy text stays varied for hundreds of
# tokens; at a "realistic" 0.02 it falls into loops within a few tokens ("UUUU…", "t t t").
WEIGHT_STD = 1.0


@dataclass(frozen=True)
class Shape:
    """The model's hyper-parameters (llama.* keys of the GGUF file)."""

    n_layer: int = 2
    n_embd: int = 64
    n_head: int = 4
    n_ff: int = 128
    n_ctx: int = 512
    rms_eps: float = 1e-5

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head


@dataclass(frozen=True)
class Vocab:
    """Token strings, their GGUF token types, the merges, and which ids may be generated."""

    tokens: list[str]
    types: list[int]
    merges: list[str]
    printable: np.ndarray  # bool mask over token ids

    def id_of(self, token: str) -> int:
        return self.tokens.index(token)


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte-to-unicode map: printable bytes stand for themselves, the
    others are moved to code points from 256 up."""
    keep = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    mapping = {b: chr(b) for b in keep}
    extra = 0
    for b in range(256):
        if b not in mapping:
            mapping[b] = chr(256 + extra)
            extra += 1
    return mapping


def build_vocab() -> Vocab:
    """256 byte tokens (id = byte value), then the merged tokens, then the special ones."""
    byte_map = bytes_to_unicode()
    tokens = [byte_map[b] for b in range(256)]
    printable = [b in PRINTABLE for b in range(256)]
    for left, right in MERGES:
        tokens.append(left + right)
        printable.append(True)  # every merge joins printable pieces
    tokens.extend(SPECIAL_TOKENS)
    printable.extend(False for _ in SPECIAL_TOKENS)
    normal, control = int(gguf.TokenType.NORMAL), int(gguf.TokenType.CONTROL)
    types = [normal] * (len(tokens) - len(SPECIAL_TOKENS)) + [control] * len(SPECIAL_TOKENS)
    merges = [f"{left} {right}" for left, right in MERGES]
    return Vocab(tokens, types, merges, np.array(printable, dtype=bool))


def random_tensors(shape: Shape, vocab: Vocab, rng: np.random.Generator) -> dict[str, np.ndarray]:
    """The llama tensors by GGUF name, float32. Numpy shapes are (rows, cols) = (ne1, ne0)."""
    n_vocab, d, ff = len(vocab.tokens), shape.n_embd, shape.n_ff

    def weight(*dims: int) -> np.ndarray:
        return (rng.standard_normal(dims) * WEIGHT_STD).astype(np.float32)

    def ones(n: int) -> np.ndarray:
        return np.ones(n, dtype=np.float32)

    tensors = {"token_embd.weight": weight(n_vocab, d)}
    for i in range(shape.n_layer):
        blk = f"blk.{i}"
        tensors |= {
            f"{blk}.attn_norm.weight": ones(d),
            f"{blk}.attn_q.weight": weight(d, d),
            f"{blk}.attn_k.weight": weight(d, d),
            f"{blk}.attn_v.weight": weight(d, d),
            f"{blk}.attn_output.weight": weight(d, d),
            f"{blk}.ffn_norm.weight": ones(d),
            f"{blk}.ffn_gate.weight": weight(ff, d),
            f"{blk}.ffn_up.weight": weight(ff, d),
            f"{blk}.ffn_down.weight": weight(d, ff),
        }
    output = weight(n_vocab, d)
    output[~vocab.printable] = 0.0  # logit exactly 0: never the argmax, never in the top-k
    tensors |= {"output_norm.weight": ones(d), "output.weight": output}
    return tensors


def add_hparams(writer: gguf.GGUFWriter, shape: Shape) -> None:
    writer.add_name("crosstalk-tiny")
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)
    writer.add_context_length(shape.n_ctx)
    writer.add_embedding_length(shape.n_embd)
    writer.add_block_count(shape.n_layer)
    writer.add_feed_forward_length(shape.n_ff)
    writer.add_head_count(shape.n_head)
    writer.add_head_count_kv(shape.n_head)
    writer.add_rope_dimension_count(shape.head_dim)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(shape.rms_eps)


def add_tokenizer(writer: gguf.GGUFWriter, vocab: Vocab) -> None:
    writer.add_vocab_size(len(vocab.tokens))
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(vocab.tokens)
    writer.add_token_types(vocab.types)
    writer.add_token_merges(vocab.merges)
    writer.add_bos_token_id(vocab.id_of(BOS))
    writer.add_eos_token_id(vocab.id_of(IM_END))
    writer.add_pad_token_id(vocab.id_of(BOS))
    writer.add_add_bos_token(False)
    writer.add_chat_template(CHATML_TEMPLATE)


def write_tiny_model(path: pathlib.Path, *, seed: int = 0) -> pathlib.Path:
    """Write the tiny model to ``path`` (same seed, same bytes) and return ``path``."""
    shape, vocab = Shape(), build_vocab()
    tensors = random_tensors(shape, vocab, np.random.default_rng(seed))
    path.parent.mkdir(parents=True, exist_ok=True)
    writer = gguf.GGUFWriter(str(path), ARCH)
    try:
        add_hparams(writer, shape)
        add_tokenizer(writer, vocab)
        for name, data in tensors.items():
            writer.add_tensor(name, data)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
    finally:
        writer.close()
    return path
