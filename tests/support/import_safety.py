"""Run as a script: eager forwards and gradients of tiny models, with or without ``import cp_attention`` first
(tests/integrations/test_import_safety.py compares the two processes' results bit for bit).

``python import_safety.py CONFIGS OUT [--with-cp-attention]``: CONFIGS is a ``torch.save`` of {family: config}
written by the test (the tiny configs of the family sweep); for each family, from seed 0: the model of the
config under ``attn_implementation="eager"`` (its weights drawn here, so the import must not change the random
state either), one forward of two rows with labels (and the router logits where the config has them), and the
backward of ``loss + 1e-3 * sum(logits * R)``. OUT receives {family: {"logits", "grads"} or {"error": text}}.
This script imports nothing of cp_attention unless asked to.
"""

from __future__ import annotations

import sys


def run(configs: dict) -> dict:
    import torch
    import transformers as tf
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    torch.set_num_threads(1)
    out = {}
    for family, config in configs.items():
        try:
            torch.manual_seed(0)
            try:
                model = tf.AutoModelForCausalLM.from_config(config, attn_implementation="eager")
            except ValueError:  # a config class AutoModelForCausalLM does not map (the sweep's decoder configs)
                cls = next(getattr(tf, name) for name in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values()
                           if getattr(getattr(tf, name, None), "config_class", None) is type(config))
                model = cls._from_config(config, attn_implementation="eager")
            model.eval()
            g = torch.Generator().manual_seed(1)
            ids = torch.randint(3, 96, (2, 24), generator=g)
            kwargs = dict(input_ids=ids, labels=ids)
            if hasattr(config, "output_router_logits"):
                kwargs["output_router_logits"] = True
            if "use_cache" in model.forward.__code__.co_varnames:
                kwargs["use_cache"] = False
            result = model(**kwargs)
            logits = result.logits.float()
            R = torch.randn(logits.shape, generator=g)
            loss = (result.loss if result.loss is not None else 0) + 1e-3 * (logits * R).sum()
            loss.backward()
            out[family] = {"logits": logits.detach(),
                           "grads": {n: p.grad.detach().clone() for n, p in model.named_parameters()
                                     if p.grad is not None}}
        except Exception as exc:  # the same in both processes, or a difference the test reports
            out[family] = {"error": f"{type(exc).__name__}: {str(exc)[:300]}"}
    return out


def main(argv: list[str]) -> None:
    if "--with-cp-attention" in argv:
        import cp_attention  # noqa: F401  (before transformers: its import hooks adapt every modeling module)
    import torch

    configs_path, out_path = [a for a in argv if not a.startswith("--")][:2]
    configs = torch.load(configs_path, weights_only=False)
    torch.save(run(configs), out_path)
    if "--with-cp-attention" not in argv:
        assert not any(name == "cp_attention" or name.startswith("cp_attention.") for name in sys.modules)


if __name__ == "__main__":
    main(sys.argv[1:])
