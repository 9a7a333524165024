"""A tiny Llama model in GGUF, written in a fraction of a second, for llama.cpp's server in tests.

Two layers, 64 wide, a character-level SentencePiece vocabulary with byte fallback (so any text
tokenizes), under 1 MB. The weights are random (seeded) except a handful of crafted rows that
make the model follow a fixed script, so tests can assert what it says:

- it answers :data:`TINY_REPLY` to anything, then ends its turn;
- when the conversation's last message is a user message starting with :data:`TINY_CALL_PREFIX`
  and the request offers tools, it calls one (``fork_agent`` when offered, the first in the
  grammar's choice otherwise) with a ``task`` argument of :data:`TINY_TASK`, then ends its turn.

How: the crafted rows are a bigram table on dimensions of their own (the layers' outputs are
zero there, so attention and feed-forward never disturb them): a token's embedding points at
its successor's output row. The chat template (Qwen2.5-style ChatML that renders ``tools``,
which llama.cpp's tool-call parser recognises) ends the generation prompt with a control
token when a call is asked for; that token's successor is ``<tool_call>``, which starts the
server's tool-call grammar, and the grammar plus the table pick the rest. Whitespace and the
byte tokens are pushed far down on every position, so the grammar's optional spaces never
vary the output and every character comes as its own token. The
vocabulary has no leading-space prefix (llama.cpp's samplers for ``tool_choice`` fail on it).

``gguf`` and ``numpy`` are imported only when a model is written: they are test dependencies.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

TINY_REPLY = "OK"
"""What the tiny model answers when it calls no tool."""
TINY_TASK = "Go"
"""The ``task`` argument of the tiny model's tool call."""
TINY_CALL_PREFIX = "Call "
"""A last user message starting with this makes the tiny model call a tool."""

_EMBED = 64
_LAYERS = 2
_HEADS = 4
_FEED_FORWARD = 128
_CALL = "<|call|>"
_SPACE = "\u2581"

# {% raw %} is not needed: the template holds no Jinja-looking text of its own.
CHAT_TEMPLATE = (
    "{%- if messages and messages[0].role == 'system' %}"
    "{%- set system = messages[0].content %}{%- set rest = messages[1:] %}"
    "{%- else %}{%- set system = '' %}{%- set rest = messages %}{%- endif %}"
    "{{- '<|im_start|>system\\n' + system }}"
    "{%- if tools %}"
    "{{- '\\n\\n# Tools\\n\\n<tools>' }}"
    "{%- for tool in tools %}{{- '\\n' + (tool | tojson) }}{%- endfor %}"
    '{{- \'\\n</tools>\\n\\nCall a function as <tool_call>{"name": <function-name>, '
    '"arguments": <args-json-object>}</tool_call>\' }}'
    "{%- endif %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- for message in rest %}"
    "{%- if message.role == 'tool' %}"
    "{{- '<|im_start|>user\\n<tool_response>\\n' + message.content"
    " + '\\n</tool_response><|im_end|>\\n' }}"
    "{%- elif message.role == 'assistant' %}"
    "{{- '<|im_start|>assistant\\n' + (message.content or '') }}"
    "{%- for call in message.tool_calls or [] %}"
    "{%- set f = call.function if call.function is defined else call %}"
    '{{- \'<tool_call>{"name": "\' + f.name + \'", "arguments": \' + (f.arguments'
    " if f.arguments is string else (f.arguments | tojson)) + '}</tool_call>' }}"
    "{%- endfor %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- else %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if tools and rest and rest[-1].role == 'user' and rest[-1].content is string"
    " and rest[-1].content.startswith('" + TINY_CALL_PREFIX + "') %}"
    "{{- '" + _CALL + "' }}{%- endif %}"
    "{%- endif %}"
)
"""ChatML with Qwen2.5-style tools; the generation prompt carries the call marker when asked."""


@dataclass(frozen=True, kw_only=True)
class TinyModel:
    """A written tiny model: where it is and what it was made to say."""

    path: Path
    vocabulary: int
    reply: str = TINY_REPLY
    task: str = TINY_TASK
    call_prefix: str = TINY_CALL_PREFIX


def write_tiny_model(path: Path, *, seed: int = 16, context_tokens: int = 16384) -> TinyModel:
    """Write the tiny model to ``path`` (a ``.gguf`` file, replaced if present). Deterministic
    for a ``seed``; about 30 ms. ``context_tokens`` is the context it claims to be trained for
    (the server's context may not exceed it)."""
    import gguf
    import numpy as np

    vocab = _Vocabulary()
    rng = np.random.default_rng(seed)
    n = len(vocab.tokens)
    embed = (rng.standard_normal((n, _EMBED)) * 0.02).astype(np.float32)
    output = (rng.standard_normal((n, _EMBED)) * 0.02).astype(np.float32)
    script = vocab.script()
    # One dimension per token with a crafted successor, and one that is the same on every
    # token (a constant, for the whitespace penalty); the layers never write to them.
    leads = sorted({token for token, _, _ in script})
    dimension = {token: index for index, token in enumerate(leads)}
    constant = len(leads)
    reserved = constant + 1
    embed[:, :reserved] = 0.0
    output[:, :reserved] = 0.0
    for token, successor, strength in script:
        embed[token, dimension[token]] = 1.0
        output[successor, dimension[token]] = strength
    embed[:, constant] = 0.05
    for token in vocab.never_generated():
        output[token, constant] = -60.0

    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_name("dsh-mesh tiny test model")
    writer.add_context_length(context_tokens)
    writer.add_embedding_length(_EMBED)
    writer.add_block_count(_LAYERS)
    writer.add_feed_forward_length(_FEED_FORWARD)
    writer.add_head_count(_HEADS)
    writer.add_head_count_kv(_HEADS)
    writer.add_rope_dimension_count(_EMBED // _HEADS)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)
    writer.add_tokenizer_model("llama")
    writer.add_token_list([t.encode() for t in vocab.tokens])
    writer.add_token_scores(vocab.scores)
    writer.add_token_types([gguf.TokenType(t) for t in vocab.types])
    writer.add_bos_token_id(vocab.id["<s>"])
    writer.add_eos_token_id(vocab.id["<|im_end|>"])
    writer.add_add_bos_token(False)
    writer.add_add_space_prefix(False)
    writer.add_chat_template(CHAT_TEMPLATE)

    def random(*shape: int, writes_residual: bool = False) -> Any:
        weights = (rng.standard_normal(shape) * 0.02).astype(np.float32)
        if writes_residual:
            weights[:reserved, :] = 0.0
        return weights

    ones = np.ones(_EMBED, np.float32)
    writer.add_tensor("token_embd.weight", embed)
    writer.add_tensor("output_norm.weight", ones)
    writer.add_tensor("output.weight", output)
    for layer in range(_LAYERS):
        block = f"blk.{layer}"
        writer.add_tensor(f"{block}.attn_norm.weight", ones)
        for name in ("q", "k", "v"):
            writer.add_tensor(f"{block}.attn_{name}.weight", random(_EMBED, _EMBED))
        writer.add_tensor(
            f"{block}.attn_output.weight", random(_EMBED, _EMBED, writes_residual=True)
        )
        writer.add_tensor(f"{block}.ffn_norm.weight", ones)
        writer.add_tensor(f"{block}.ffn_gate.weight", random(_FEED_FORWARD, _EMBED))
        writer.add_tensor(f"{block}.ffn_up.weight", random(_FEED_FORWARD, _EMBED))
        writer.add_tensor(
            f"{block}.ffn_down.weight", random(_EMBED, _FEED_FORWARD, writes_residual=True)
        )
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return TinyModel(path=path, vocabulary=n)


# GGUF token types (gguf.TokenType), as plain numbers so this module imports without gguf.
_NORMAL, _UNKNOWN, _CONTROL, _USER_DEFINED, _BYTE = 1, 2, 3, 4, 6


class _Vocabulary:
    """Control tokens, the 256 byte-fallback tokens, ``<tool_call>`` and ``</tool_call>`` (plain
    text to the server, so its parser sees them), and every printable ASCII character."""

    def __init__(self) -> None:
        self.tokens: list[str] = []
        self.scores: list[float] = []
        self.types: list[int] = []
        self.id: dict[str, int] = {}
        for name in ("<unk>", "<s>", "</s>"):
            self._add(name, _UNKNOWN if name == "<unk>" else _CONTROL)
        for byte in range(256):
            self._add(f"<0x{byte:02X}>", _BYTE)
        for name in ("<|im_start|>", "<|im_end|>", _CALL):
            self._add(name, _CONTROL)
        for name in ("<tool_call>", "</tool_call>"):
            self._add(name, _USER_DEFINED)
        for code in range(0x21, 0x7F):
            self._add(chr(code), _NORMAL, score=-1.0)
        self._add(_SPACE, _NORMAL, score=-1.0)

    def _add(self, text: str, kind: int, *, score: float = 0.0) -> None:
        self.id[text] = len(self.tokens)
        self.tokens.append(text)
        self.scores.append(score)
        self.types.append(kind)

    def byte(self, value: int) -> int:
        return self.id[f"<0x{value:02X}>"]

    def script(self) -> list[tuple[int, int, float]]:
        """(token, successor, strength): the bigram table that makes the model's script."""
        t = self.id
        chain = [
            # The answer: the generation prompt ends with a newline; "OK", then end of turn.
            (self.byte(0x0A), t["O"], 8.0),
            (t["O"], t["K"], 8.0),
            (t["K"], t["<|im_end|>"], 8.0),
            # The call: marker, <tool_call>, {"name": "f...  "task": "Go"}}</tool_call>, end.
            (t[_CALL], t["<tool_call>"], 8.0),
            (t["<tool_call>"], t["{"], 8.0),
            (t["{"], t['"'], 8.0),
            (t['"'], t["G"], 8.0),
            (t["G"], t["o"], 8.0),
            (t["o"], t['"'], 8.0),
            (t["}"], t["</tool_call>"], 8.0),
            (t["</tool_call>"], t["<|im_end|>"], 8.0),
        ]
        # Where the grammar rules out "G" after a quote (a tool's name), prefer fork_agent.
        chain.append((t['"'], t["f"], 6.0))
        return chain

    def never_generated(self) -> list[int]:
        """Tokens pushed far down everywhere: the space and every byte token. A grammar's
        optional whitespace then never varies the output, and a character is always generated
        as its own token, never as its byte (whose embedding the script does not know)."""
        return [self.byte(value) for value in range(256)] + [self.id[_SPACE]]
