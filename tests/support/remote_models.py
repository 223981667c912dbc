"""Tiny ``trust_remote_code`` checkpoints for the tests of the model check: a Qwen3 causal LM whose MLP
mixes tokens, in modeling code the library has never seen.

:func:`save_remote_model` writes a checkpoint directory (``config.json`` with its ``auto_map``,
``configuration_mixlm.py``, ``modeling_mixlm.py`` and the weights); :func:`load_remote_model` loads it
with ``AutoModelForCausalLM.from_pretrained(..., trust_remote_code=True)``. The model ("mixlm") is
transformers' Qwen3 with one class replaced: its MLP first adds ``0.5 * term(x)`` to its input ``x``
(in every layer from the config's ``mix_from_layer`` on, default 0)
(batch, seq, hidden), ``term`` one of :data:`MIXING_OPS`, an ordinary torch operation that mixes the
sequence's tokens. Attention stays Qwen3's (transformers' attention interface, so ``eager``, ``sdpa``
and ``cp_flash`` all run it). Under context parallelism each rank holds a shard of the tokens, so such a
term is wrong there whatever attention does; the tests check that cp_attention refuses these models.
``op=None`` writes the same model without the term: plain Qwen3 under another name.

The modeling file is generated per op and holds only that op's code (its first line names the op), so
transformers' dynamic-module cache (``HF_MODULES_CACHE``, keyed by directory name and file contents)
never hands one op's code to another's checkpoint.
"""

from __future__ import annotations

import json
import pathlib
import textwrap

import torch

__all__ = ["MIXING_OPS", "save_remote_model", "load_remote_model"]

# op -> (what the term is, lines of MixlmMLP.__init__ after super().__init__, body of MixlmMLP.token_term(x))
_TERMS: dict[str, tuple[str, str, str]] = {
    "cumulative_mean": (
        "the running mean of the tokens so far",
        "",
        """
        counts = torch.arange(1, x.shape[1] + 1, device=x.device, dtype=x.dtype)
        return torch.cumsum(x, dim=1) / counts[None, :, None]
        """),
    "previous_token": (
        "the previous token's input (F.pad of a shifted slice)",
        "",
        """
        return F.pad(x[:, :-1], (0, 0, 1, 0))
        """),
    "shifted_slice": (
        "the previous token's input (zeros concatenated before a shifted slice)",
        "",
        """
        return torch.cat([torch.zeros_like(x[:, :1]), x[:, :-1]], dim=1)
        """),
    "roll": (
        "the previous token's input, rolled (the first token gets the last one's)",
        "",
        """
        return torch.roll(x, 1, dims=1)
        """),
    "sequence_mean": (
        "the mean over all the tokens of the sequence",
        "",
        """
        return x.mean(dim=1, keepdim=True)
        """),
    "avg_pool": (
        "the average of each token's 3-token neighbourhood",
        "",
        """
        return F.avg_pool1d(x.transpose(1, 2), kernel_size=3, stride=1, padding=1).transpose(1, 2)
        """),
    "conv": (
        "a depthwise causal convolution over the last 3 tokens",
        """
        self.token_filter = nn.Parameter(torch.randn(config.hidden_size, 1, 3) / 3)
        """,
        """
        padded = F.pad(x.transpose(1, 2), (2, 0))
        return F.conv1d(padded, self.token_filter, groups=x.shape[-1]).transpose(1, 2)
        """),
    "sort": (
        "the tokens sorted along the sequence, channel by channel",
        "",
        """
        return torch.sort(x, dim=1).values
        """),
    "token_matmul": (
        "a hidden x hidden mixing matrix built from all the tokens (x^T x / L)",
        "",
        """
        mixing = x.transpose(1, 2) @ x / x.shape[1]
        return x @ mixing
        """),
    "gather": (
        "the input of the token two positions back (the first token's for positions 0 and 1)",
        "",
        """
        source = (torch.arange(x.shape[1], device=x.device) - 2).clamp(min=0)
        return x.index_select(1, source)
        """),
}

MIXING_OPS: tuple[str, ...] = tuple(_TERMS)
"""The token-mixing terms a checkpoint's MLP can add, by name."""

_AUTO_MAP = {"AutoConfig": "configuration_mixlm.MixlmConfig",
             "AutoModelForCausalLM": "modeling_mixlm.MixlmForCausalLM"}


def _tiny_config(layers: int) -> dict:
    return dict(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
                num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=512,
                tie_word_embeddings=False, attention_dropout=0.0, pad_token_id=0, bos_token_id=1, eos_token_id=2)


def _configuration_source(op: str | None) -> str:
    return textwrap.dedent(f'''\
        """Mixlm configuration (op: {op}); written by the cp_attention tests (tests/support/remote_models.py)."""

        from transformers.models.qwen3.configuration_qwen3 import Qwen3Config


        class MixlmConfig(Qwen3Config):
            """Qwen3's configuration under the model type "mixlm"."""

            model_type = "mixlm"
        ''')


def _indented(code: str, spaces: int) -> str:
    """``code`` dedented, stripped of its blank first and last lines and indented by ``spaces``."""
    return textwrap.indent(textwrap.dedent(code).strip("\n"), " " * spaces) + "\n"


def _mlp_source(op: str | None) -> str:
    if op is None:
        return ('class MixlmMLP(Qwen3MLP):\n    """Qwen3\'s MLP, unchanged."""\n\n'
                "    def __init__(self, config, layer_idx=0):\n        super().__init__(config)\n")
    what, init, term = _TERMS[op]
    return ("class MixlmMLP(Qwen3MLP):\n"
            f'    """Qwen3\'s MLP on its input plus half of {what}."""\n'
            "\n"
            "    def __init__(self, config, layer_idx=0):\n"
            "        super().__init__(config)\n"
            "        self.mixes = layer_idx >= getattr(config, 'mix_from_layer', 0)\n"
            + (_indented(init, 8) if init.strip() else "")
            + "\n"
            "    def forward(self, x):\n"
            "        return super().forward(x + 0.5 * self.token_term(x) if self.mixes else x)\n"
            "\n"
            "    def token_term(self, x):\n"
            + _indented(term, 8))


def _modeling_source(op: str | None) -> str:
    what = "none, plain Qwen3" if op is None else f"{op}, {_TERMS[op][0]}"
    head = textwrap.dedent(f'''\
        """Mixlm, Qwen3 with its own MLP (op: {what}).

        Written by the cp_attention tests (tests/support/remote_models.py).
        """

        import torch
        import torch.nn.functional as F
        from torch import nn
        from transformers.models.qwen3.modeling_qwen3 import Qwen3DecoderLayer, Qwen3ForCausalLM, Qwen3MLP, Qwen3Model

        from .configuration_mixlm import MixlmConfig


        ''')
    tail = textwrap.dedent('''

        class MixlmDecoderLayer(Qwen3DecoderLayer):
            def __init__(self, config, layer_idx):
                super().__init__(config, layer_idx)
                self.mlp = MixlmMLP(config, layer_idx)


        class MixlmModel(Qwen3Model):
            config_class = MixlmConfig
            _no_split_modules = ["MixlmDecoderLayer"]

            def __init__(self, config):
                super().__init__(config)
                self.layers = nn.ModuleList(
                    [MixlmDecoderLayer(config, layer_idx) for layer_idx in range(config.num_hidden_layers)])
                self.post_init()


        class MixlmForCausalLM(Qwen3ForCausalLM):
            config_class = MixlmConfig
            _no_split_modules = ["MixlmDecoderLayer"]

            def __init__(self, config):
                super().__init__(config)
                self.model = MixlmModel(config)
                self.post_init()
        ''')
    return head + _mlp_source(op) + tail


def save_remote_model(directory, op: str | None, *, seed: int = 0, dtype=torch.float32,
                      layers: int = 2) -> pathlib.Path:
    """Writes config.json (+ auto_map), the configuration and modeling .py files and the weights into a NEW
    sub-directory of `directory` whose name is unique to (op, seed, layers) (``mixlm_{op or 'none'}_{seed}_{layers}``),
    and returns that path. op=None: the same model without the term (it then behaves as plain Qwen3).

    The weights are drawn from ``torch.manual_seed(seed)`` (transformers' initialisation, and for "conv"
    the filter) and saved in ``dtype``. Writing the same (op, seed, layers) again rewrites the same files."""
    from transformers import AutoConfig, AutoModelForCausalLM

    if op is not None and op not in _TERMS:
        raise ValueError(f"unknown mixing op {op!r}; one of {MIXING_OPS} or None")
    target = pathlib.Path(directory) / f"mixlm_{op or 'none'}_{seed}_{layers}"
    target.mkdir(parents=True, exist_ok=True)
    (target / "configuration_mixlm.py").write_text(_configuration_source(op))
    (target / "modeling_mixlm.py").write_text(_modeling_source(op))
    (target / "config.json").write_text(json.dumps(
        dict(_tiny_config(layers), model_type="mixlm", architectures=["MixlmForCausalLM"], auto_map=_AUTO_MAP),
        indent=2))
    config = AutoConfig.from_pretrained(target, trust_remote_code=True)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, trust_remote_code=True, dtype=dtype)
    model.save_pretrained(target)
    return target


def load_remote_model(path, attn_implementation: str, dtype=None):
    """AutoModelForCausalLM.from_pretrained(path, trust_remote_code=True, attn_implementation=...), eval mode
    (in ``dtype`` when given, else the saved one)."""
    from transformers import AutoModelForCausalLM

    kwargs = {} if dtype is None else {"dtype": dtype}
    model = AutoModelForCausalLM.from_pretrained(path, trust_remote_code=True,
                                                 attn_implementation=attn_implementation, **kwargs)
    return model.eval()
