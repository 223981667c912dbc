"""The catalogue of refusals (cp_attention/refusals.py): the generated page is current, every raise
site names a catalogued key with the fields its message needs and every key is raised somewhere, the
converted modules construct no NotImplementedError of their own, ``refuse`` fills its template and
refuses a wrong call clearly, and refusals triggered through the public path keep their messages
byte for byte (tests elsewhere match on them)."""

from __future__ import annotations

import ast
import os
import shutil
import types

import pytest
import torch

from cp_attention.refusals import AREAS, REFUSALS, DenseMaskError, Refusal, refuse
from cp_attention.tools import refusal_page

ROOT = os.path.dirname(os.path.abspath(__file__))
while not os.path.exists(os.path.join(ROOT, "pyproject.toml")):
    ROOT = os.path.dirname(ROOT)
PACKAGE = os.path.join(ROOT, "cp_attention")
PAGE = os.path.join(ROOT, "docs", "refusals.md")
# the modules whose refusals go through the catalogue: no NotImplementedError of their own
CONVERTED = ["engine/layer.py", "engine/local.py"] + sorted(
    os.path.relpath(os.path.join(folder, name), PACKAGE).replace(os.sep, "/")
    for folder, _, files in os.walk(os.path.join(PACKAGE, "integrations")) for name in files if name.endswith(".py"))


def _sources(package: str = PACKAGE):
    """(path relative to the package, parsed module) of every module of the package."""
    for folder, _, files in os.walk(package):
        for name in sorted(files):
            if name.endswith(".py"):
                path = os.path.join(folder, name)
                with open(path, encoding="utf-8") as f:
                    yield os.path.relpath(path, package), ast.parse(f.read(), path)


def refuse_calls(package: str = PACKAGE) -> list[tuple[str, int, str | None, tuple[str, ...]]]:
    """(file, line, key or None when not a literal, keyword names) of every ``refuse(...)`` call."""
    found = []
    for rel, tree in _sources(package):
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and (getattr(node.func, "id", None) == "refuse"
                                               or getattr(node.func, "attr", None) == "refuse"):
                first = node.args[0] if node.args else None
                key = first.value if isinstance(first, ast.Constant) and isinstance(first.value, str) else None
                found.append((rel, node.lineno, key, tuple(k.arg for k in node.keywords)))
    return found


def call_site_problems(package: str = PACKAGE) -> list[str]:
    """Every call site naming no catalogued key (or no literal one), or passing other fields than its
    message names; every catalogued key raised nowhere."""
    problems, used = [], set()
    for rel, line, key, names in refuse_calls(package):
        where = f"{rel}:{line}"
        if key is None:
            problems.append(f"{where}: refuse's key is not a string literal")
        elif key not in REFUSALS:
            problems.append(f"{where}: refuse({key!r}) names no refusal of the catalogue")
        else:
            used.add(key)
            if None in names:
                problems.append(f"{where}: refuse({key!r}, **...): pass the fields by name")
            elif sorted(names) != sorted(REFUSALS[key].fields):
                problems.append(f"{where}: refuse({key!r}) passes {sorted(names)}, its message names "
                                f"{sorted(REFUSALS[key].fields)}")
    problems += [f"refusal {key!r} is raised nowhere in the package" for key in REFUSALS if key not in used]
    return problems


def direct_errors(package: str = PACKAGE, files=CONVERTED) -> list[str]:
    """A NotImplementedError (or DenseMaskError) the converted modules construct or raise themselves."""
    problems = []
    for rel in files:
        path = os.path.join(package, rel)
        with open(path, encoding="utf-8") as f:
            tree = ast.parse(f.read(), path)
        for node in ast.walk(tree):
            target = node.func if isinstance(node, ast.Call) else node.exc if isinstance(node, ast.Raise) else None
            if isinstance(target, ast.Name) and target.id in ("NotImplementedError", "DenseMaskError"):
                problems.append(f"{rel}:{node.lineno} makes a {target.id} of its own: add the refusal to "
                                "cp_attention/refusals.py and raise refuse(key, ...)")
    return problems


# ----------------------------------------------------------------------------------------------
# (a) the page


def page_problems(path: str = PAGE) -> list[str]:
    """What is wrong with the page at ``path``: its marker, its command line, or stale content."""
    with open(path, encoding="utf-8") as f:
        page = f.read()
    lines = page.splitlines() + ["", ""]
    problems = [] if lines[0] == refusal_page.MARKER else [f"its first line is not {refusal_page.MARKER}"]
    if refusal_page.COMMAND not in lines[1]:
        problems.append(f"its second line does not name {refusal_page.COMMAND}")
    if page != refusal_page.render():
        problems.append(f"docs/refusals.md is stale: run {refusal_page.COMMAND}")
    return problems


def test_the_page_is_current():
    assert page_problems() == []


def test_the_page_has_every_refusal_in_its_area():
    page = refusal_page.render()
    for area, title in AREAS.items():
        assert f"## {title}\n" in page
    for key, refusal in REFUSALS.items():
        row = next(line for line in page.splitlines() if line.startswith(f"| `{key}` |"))
        assert f"`{refusal.exception.__name__}`" in row
        section = page[:page.index(row)].rsplit("\n## ", 1)[1].split("\n", 1)[0]
        assert section == AREAS[refusal.area]


def test_main_writes_the_page(tmp_path, capsys):
    path = tmp_path / "refusals.md"
    assert refusal_page.main([str(path)]) == 0
    assert path.read_text(encoding="utf-8") == refusal_page.render()


def test_a_stale_page_is_caught(tmp_path):
    path = tmp_path / "refusals.md"
    path.write_text(refusal_page.render().replace("use_cache=False |", "use_cache=False (stale) |", 1),
                    encoding="utf-8")
    assert page_problems(str(path)) == [f"docs/refusals.md is stale: run {refusal_page.COMMAND}"]


# ----------------------------------------------------------------------------------------------
# (b), (c) the call sites


def test_every_call_site_names_a_catalogued_key_and_every_key_is_raised():
    assert call_site_problems() == []


def test_the_converted_modules_make_no_refusal_of_their_own():
    assert direct_errors() == []


def _planted_package(tmp_path, rel: str, old: str, new: str) -> str:
    package = tmp_path / "cp_attention"
    shutil.copytree(PACKAGE, package, ignore=shutil.ignore_patterns("__pycache__"))
    path = package / rel
    source = path.read_text(encoding="utf-8")
    assert source.count(old) == 1, old
    path.write_text(source.replace(old, new), encoding="utf-8")
    return str(package)


def test_an_unknown_key_or_a_missing_field_at_a_call_site_is_caught(tmp_path):
    package = _planted_package(tmp_path, "engine/local.py", 'refuse("packed_after_kv_cache")',
                               'refuse("packed_after_a_cache")')
    problems = call_site_problems(package)
    assert any("refuse('packed_after_a_cache') names no refusal" in p for p in problems), problems
    assert any("'packed_after_kv_cache' is raised nowhere" in p for p in problems), problems
    package = _planted_package(tmp_path / "b", "engine/local.py", 'refuse("cu_seqlens_appended_keys", tokens=Lq, keys=Lk)',
                               'refuse("cu_seqlens_appended_keys", tokens=Lq)')
    assert any("passes ['tokens'], its message names ['keys', 'tokens']" in p for p in call_site_problems(package))


def test_a_direct_not_implemented_error_is_caught(tmp_path):
    package = _planted_package(tmp_path, "engine/local.py", 'raise refuse("packed_after_kv_cache")',
                               'raise NotImplementedError("cp_flash: packed documents after a KV cache")')
    assert any("engine/local.py" in p and "NotImplementedError of its own" in p for p in direct_errors(package))


# ----------------------------------------------------------------------------------------------
# (d) the catalogue and refuse()


def test_the_catalogue_is_ordered_by_area_and_complete():
    assert isinstance(REFUSALS, types.MappingProxyType)
    areas = [r.area for r in REFUSALS.values()]
    assert areas == sorted(areas, key=list(AREAS).index)
    for key, refusal in REFUSALS.items():
        assert isinstance(refusal, Refusal) and refusal.key == key and key.isidentifier()
        assert refusal.area in AREAS and issubclass(refusal.exception, Exception)
        for text in (refusal.what, refusal.why, refusal.fix):
            assert text and "\n" not in text and text == text.strip(), (key, text)
    with pytest.raises(AttributeError):
        REFUSALS["kv_cache_under_cp"].message = "changed"  # frozen


def test_refuse_fills_the_fields():
    error = refuse("kv_cache_under_cp", queries=3, offset=5, keys=8)
    assert type(error) is ValueError
    assert str(error).startswith("cp_flash: a non-empty KV cache that context parallelism did not shard (queries 3 "
                                 "from position 5, keys 8); run model.generate inside")
    error = refuse("num_items_mismatch", value=2.5, want=4.0, items=8.0, ranks=2)  # format specs kept
    assert "num_items_in_batch=2.5 was handed" in str(error) and "binds 4 (its 8 label tokens / 2 ranks" in str(error)
    assert "logits_to_keep='x'" in str(refuse("logits_to_keep_without_ids", keep="x"))  # !r kept
    assert REFUSALS["kv_cache_under_cp"].fields == ("queries", "offset", "keys")
    assert REFUSALS["torch_context_parallel"].fields == ()


def test_refuse_refuses_a_missing_or_extra_field_and_an_unknown_key():
    with pytest.raises(TypeError, match=r"refuse\('kv_cache_under_cp'\).*missing \['keys'\]"):
        refuse("kv_cache_under_cp", queries=3, offset=5)
    with pytest.raises(TypeError, match=r"not in the message \['layer'\]"):
        refuse("kv_cache_under_cp", queries=3, offset=5, keys=8, layer=0)
    with pytest.raises(KeyError, match="no such refusal"):
        refuse("no_such_refusal")


def test_a_template_naming_an_unpassed_field_raises_clearly():
    broken = Refusal(key="broken", exception=ValueError, area="context", what="w", why="y", fix="f",
                     message="needs {one} and {two}")
    with pytest.raises(TypeError, match=r"names the fields \['one', 'two'\]; missing \['two'\]"):
        broken.error(one=1)
    assert str(broken.error(one=1, two=2)) == "needs 1 and 2"


# ----------------------------------------------------------------------------------------------
# (e) through the public path, messages as before the catalogue


def test_local_meta_cu_seqlens_with_appended_keys():
    from cp_attention.engine.local import local_meta

    with pytest.raises(NotImplementedError) as info:
        local_meta(1, 4, 6, cu_seqlens=torch.tensor([0, 4]))
    assert str(info.value) == (
        "cp_flash: cu_seq_lens_* describe one packed row of 4 tokens, but the layer has 6 keys and no KV cache: "
        "keys that are not the row's own tokens (e.g. compressed K/V the model appends to the keys) are not "
        "supported with cu_seq_lens_*")


def test_local_meta_kv_cache_refusals():
    from cp_attention.engine.local import local_meta

    with pytest.raises(ValueError) as info:
        local_meta(1, 2, 6, q_offset=4, cu_seqlens=torch.tensor([0, 2]))
    assert str(info.value) == "cp_flash: cu_seq_lens_* with a non-empty KV cache is not supported"
    with pytest.raises(ValueError) as info:
        local_meta(1, 3, 7, q_offset=4, position_ids=torch.tensor([[4, 0, 1]]))
    assert str(info.value) == ("cp_flash: packed documents (restarting position_ids) after a non-empty KV cache "
                               "are not supported")


def test_torch_context_parallel_is_refused(monkeypatch):
    from cp_attention import MaskSpec
    from cp_attention.engine import layer

    monkeypatch.setattr(layer, "torch_context_parallel_active", lambda: True)
    q = torch.randn(1, 4, 2, 8)
    with pytest.raises(RuntimeError) as info:
        layer.attend_layer(q, q, q, MaskSpec(causal=True))
    assert str(info.value) == (
        "cp_flash: torch's context_parallel (accelerate's ParallelismConfig(cp_size > 1)) is active: it shards the "
        "sequence itself and cp_flash would attend within one shard. cp_flash does its own context parallelism: "
        "use cp_attention.context_parallel() + cp.shard_batch(), or CPTrainer from "
        "cp_attention.integrations.trainers.trainer, without torch's context_parallel (or use attn_implementation='sdpa' "
        "with torch's context_parallel, for plain causal masks only)")


def test_cp_flash_refuses_dropout_and_a_dense_mask():
    from cp_attention.integrations.hf.attention import cp_flash_attention

    module = torch.nn.Module().train()
    q = torch.randn(1, 2, 4, 8)
    with pytest.raises(NotImplementedError) as info:
        cp_flash_attention(module, q, q, q, None, dropout=0.1)
    assert str(info.value) == ("cp_flash does not implement attention dropout (got dropout=0.1); set the model's "
                               "attention_dropout to 0")
    with pytest.raises(DenseMaskError) as info:
        cp_flash_attention(module, q, q, q, torch.zeros(1, 1, 4, 4))
    assert isinstance(info.value, NotImplementedError) and isinstance(info.value, ValueError)
    assert str(info.value) == (
        "cp_flash received a dense (1, 1, 4, 4) attention_mask tensor in this model, which it cannot apply: its "
        "masks come from the mask function registered with it. If you passed it, pass a 2D padding mask (or none) "
        "and position_ids; if the model builds it itself (BLT's byte and patch masks), cp_flash does not support "
        "this family: use attn_implementation=\"eager\" or \"sdpa\"")


def test_cp_trainer_refuses_a_model_without_cp_flash(tmp_path):
    from transformers import TrainingArguments

    from cp_attention.integrations.trainers.trainer import CPTrainer
    from cp_attention.tools.tiny_models import tiny_model

    args = TrainingArguments(output_dir=str(tmp_path), report_to=[], use_cpu=True, max_steps=1,
                             per_device_train_batch_size=1)
    with pytest.raises(ValueError) as info:
        CPTrainer(model=tiny_model("mistral", "eager", window=8), args=args,
                  train_dataset=[{"input_ids": [3, 4, 5], "labels": [3, 4, 5]}])
    assert str(info.value) == "CPTrainer trains models loaded with attn_implementation='cp_flash', this one uses 'eager'"
