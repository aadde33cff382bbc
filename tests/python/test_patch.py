"""`patch_model_members` (the seed's, docs/kernels.md) through `fsdp_turbo.utils.patch`:
plain-function instance attributes set unbound (HF's `self.chunk_gated_delta_rule = fn`),
bound methods and classmethods rebound, subclasses matched, properties rebuilt with their
setter, idempotence by replacement identity, dotted paths with the suffix retry, and every
error text of the seed."""
import functools
import os.path
import sys
import textwrap

import pytest
import torch
from torch import nn

from fsdp_turbo.utils.patch import PATCH_IDS_ATTR, import_module_or_suffix, patch_model_members, resolve_callable


def hf_kernel(query, key, *, scale=1.0):
    return ("hf", query, key, scale)


def fast_kernel(query, key, *, scale=1.0, chunk_size=64):
    return ("fast", query, key, scale, chunk_size)


class LinearAttn(nn.Module):
    """As HF's linear-attention layers: the kernel is a plain function on the instance."""

    def __init__(self):
        super().__init__()
        self.chunk_gated_delta_rule = hf_kernel
        self.proj = nn.Linear(2, 2)
        self._scale = 1.0

    def forward(self, x):
        return self.chunk_gated_delta_rule(x, x, scale=self.scale)

    def describe(self):
        return "original"

    @classmethod
    def kind(cls):
        return "original"

    @property
    def scale(self):
        """The kernel scale."""
        return self._scale

    @scale.setter
    def scale(self, value):
        self._scale = value


class SubAttn(LinearAttn):
    pass


class WriteOnly(nn.Module):
    def _set(self, value):
        self.value = value

    secret = property(None, _set)


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList([LinearAttn(), SubAttn(), nn.Linear(2, 2)])
        self.extra = WriteOnly()


def target(cls, member):
    return f"{cls.__module__}.{cls.__qualname__}.{member}"


def test_plain_function_attribute_is_set_unbound_on_every_subclass_instance():
    model = Model()
    bound = functools.partial(fast_kernel, chunk_size=32)
    assert patch_model_members(model, [target(LinearAttn, "chunk_gated_delta_rule")], bound) == 2
    for layer in model.layers[:2]:
        assert layer.chunk_gated_delta_rule is bound
        assert layer(torch.ones(1)) == ("fast", torch.ones(1), torch.ones(1), 1.0, 32)
    # The class and other instances are untouched.
    assert not hasattr(LinearAttn, "chunk_gated_delta_rule")
    assert LinearAttn().chunk_gated_delta_rule is hf_kernel


def test_bound_methods_and_classmethods_are_rebound():
    model = Model()

    def describe(self):
        return f"patched {type(self).__name__}"

    def kind(cls):
        return f"patched {cls.__name__}"

    assert patch_model_members(model, [target(LinearAttn, "describe"), target(LinearAttn, "kind")],
                               [describe, kind]) == 4
    assert [m.describe() for m in model.layers[:2]] == ["patched LinearAttn", "patched SubAttn"]
    assert [m.kind() for m in model.layers[:2]] == ["patched LinearAttn", "patched SubAttn"]
    assert "describe" in vars(model.layers[0]), "installed on the instance"
    assert LinearAttn().describe() == "original"


def test_property_gets_a_new_getter_and_keeps_its_setter_and_doc():
    model = Model()
    try:
        assert patch_model_members(model, target(SubAttn, "scale"), lambda self: self._scale * 10) == 1
        sub = model.layers[1]
        assert sub.scale == 10.0
        sub.scale = 3.0
        assert sub.scale == 30.0
        assert SubAttn.scale.__doc__ == "The kernel scale."
        assert "scale" in vars(LinearAttn), "rebuilt on the class in the MRO that defines it"
        with pytest.raises(TypeError, match=r"Cannot patch write-only property .*WriteOnly\.secret\."):
            patch_model_members(model, target(WriteOnly, "secret"), lambda self: 0)
    finally:
        LinearAttn.scale = property(lambda self: self._scale, lambda self, v: setattr(self, "_scale", v),
                                    doc="The kernel scale.")


def test_idempotent_for_the_same_replacement_and_reinstalled_for_a_new_one():
    model = Model()
    t = target(LinearAttn, "chunk_gated_delta_rule")
    partial = functools.partial(fast_kernel, chunk_size=16)
    assert patch_model_members(model, t, partial) == 2
    assert getattr(partial, PATCH_IDS_ATTR)[0][2] == id(partial)
    sentinel = model.layers[0].chunk_gated_delta_rule
    assert patch_model_members(model, t, partial) == 2, "matched modules are still counted"
    assert model.layers[0].chunk_gated_delta_rule is sentinel
    again = functools.partial(fast_kernel, chunk_size=16)
    assert patch_model_members(model, t, again) == 2
    assert model.layers[0].chunk_gated_delta_rule is again

    def describe(self):
        return "once"

    assert patch_model_members(model, target(LinearAttn, "describe"), describe) == 2
    first = vars(model.layers[0])["describe"]
    assert patch_model_members(model, target(LinearAttn, "describe"), describe) == 2
    assert vars(model.layers[0])["describe"] is first


def test_one_replacement_per_target_and_dotted_paths():
    model = Model()
    targets = [target(LinearAttn, "chunk_gated_delta_rule"), target(SubAttn, "describe")]
    assert patch_model_members(model, targets, [f"{__name__}.fast_kernel", f"{__name__}.hf_kernel"]) == 3
    assert model.layers[0].chunk_gated_delta_rule is fast_kernel
    assert model.layers[1].describe.__func__ is hf_kernel and model.layers[1].describe.__self__ is model.layers[1]
    # The suffix retry: "not_a_package.os.path" imports "os.path".
    assert resolve_callable("not_a_package.os.path.join") is os.path.join
    assert import_module_or_suffix("not_a_package.os.path") is os.path


def test_errors_are_the_seeds(tmp_path, monkeypatch):
    model = Model()
    t = target(LinearAttn, "chunk_gated_delta_rule")
    with pytest.raises(ValueError, match=r"^targets must not be empty\.$"):
        patch_model_members(model, [], fast_kernel)
    with pytest.raises(ValueError, match=r"^replacements must contain either 1 item or the same number"):
        patch_model_members(model, [t, t, t], [fast_kernel, fast_kernel])
    with pytest.raises(ValueError, match=r"^Use dotted callable paths, not colon paths: 'os.path:join'\.$"):
        patch_model_members(model, t, "os.path:join")
    with pytest.raises(ValueError, match=r"^Invalid callable path 'join'\.$"):
        patch_model_members(model, t, "join")
    with pytest.raises(TypeError, match=r"^Resolved object 'os.sep' is not callable\.$"):
        patch_model_members(model, t, "os.sep")
    with pytest.raises(ModuleNotFoundError, match=r"^No module named 'no_such_a.no_such_b'\.$"):
        patch_model_members(model, t, "no_such_a.no_such_b.f")
    with pytest.raises(ValueError, match=r"^Invalid class member path 'member'\.$"):
        patch_model_members(model, "member", fast_kernel)
    with pytest.raises(ValueError, match=r"^Invalid class member path 'Class.member'; use 'module.Class.member'\.$"):
        patch_model_members(model, "Class.member", fast_kernel)
    with pytest.raises(TypeError, match=r"^Resolved class 'os.sep' is not a type\.$"):
        patch_model_members(model, "os.sep.member", fast_kernel)
    with pytest.raises(TypeError, match=r"^Target member '.*LinearAttn._scale' is neither a property nor a callable\.$"):
        patch_model_members(model, target(LinearAttn, "_scale"), fast_kernel)
    with pytest.raises(AttributeError, match=r"LinearAttn has no attribute 'missing'"):
        patch_model_members(model, target(LinearAttn, "missing"), fast_kernel)
    # A module whose own import fails for a missing dependency is reported as that failure, not
    # retried with a shorter path.
    (tmp_path / "broken_kernels.py").write_text(textwrap.dedent("""
        import definitely_missing_dependency
        def f():
            pass
    """))
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ModuleNotFoundError, match=r"definitely_missing_dependency"):
        resolve_callable("broken_kernels.f")
    sys.modules.pop("broken_kernels", None)
    # Nothing matched: 0, nothing installed.
    assert patch_model_members(nn.Linear(2, 2), t, fast_kernel) == 0
