"""The plugin manager and registries: duplicates, unknown names, auto, lazy loading."""

from __future__ import annotations

import inspect
import subprocess
import sys
import types

import pytest

from gem_core import hookimpl, hookspecs
from gem_core.errors import GemConfigError, GemPluginError
from gem_core.plugins import build_plugins
from gem_core.registry import KINDS, AutoContext, ImplementationSpec


def _plugin(**hooks) -> types.SimpleNamespace:
    return types.SimpleNamespace(**{name: hookimpl(fn) for name, fn in hooks.items()})


def _spec(name: str, value: object = None) -> ImplementationSpec:
    return ImplementationSpec(name=name, load=lambda: value, description=f"test {name}")


def test_every_kind_has_at_least_the_reference_implementation():
    plugins = build_plugins(load_entry_points=False)
    for kind in KINDS:
        assert plugins.registry(kind).names(), f"gem-core registers no {kind}"
        for spec in plugins.registry(kind).specs():
            assert spec.distribution == "gem-core" and spec.kind == kind


def test_duplicate_name_is_an_error_naming_both_plugins():
    def register(register):
        register(_spec("bucketed"))

    with pytest.raises(GemPluginError) as error:
        copycat = _plugin(gem_register_attention_backends=register)
        build_plugins(load_entry_points=False, extra_plugins=[("copycat", copycat)])
    message = str(error.value)
    assert "duplicate attention name 'bucketed'" in message
    assert "'gem_core'" in message and "'copycat'" in message


def test_registering_something_else_than_a_spec_is_an_error():
    def register(register):
        register("triton")

    with pytest.raises(GemPluginError, match="passed str to register"):
        build_plugins(load_entry_points=False,
                      extra_plugins=[("sloppy", _plugin(gem_register_attention_backends=register))])


def test_unknown_name_lists_what_is_installed():
    plugins = build_plugins(load_entry_points=False)
    with pytest.raises(GemConfigError, match=r"unknown attention implementation 'nope'; "
                                             r"installed: bucketed, padded, reference"):
        plugins.resolve("attention", "nope", AutoContext(device="cpu"))


def test_spec_names_are_checked():
    for bad in ("", "auto", "has space"):
        with pytest.raises(ValueError, match="name must be a non-empty word"):
            ImplementationSpec(name=bad, load=lambda: None)


def test_a_plugin_answer_for_auto_wins_over_gem_core_and_gives_its_reason():
    from gem_core.attention.reference import ReferenceAttention

    marker = ReferenceAttention()

    def register(register):
        register(_spec("mine", marker))

    def default(context):
        return ("mine", "because the test says so") if context.device == "cpu" else None

    plugins = build_plugins(load_entry_points=False, extra_plugins=[(
        "mine", _plugin(gem_register_attention_backends=register, gem_default_attention=default))])
    chosen = plugins.resolve("attention", "auto", AutoContext(device="cpu"))
    assert chosen.spec.name == "mine" and chosen.impl is marker
    assert chosen.reason == "auto: because the test says so"
    # On another device the plugin passes and gem-core answers last.
    assert plugins.default_for("attention", AutoContext(device="cuda"))[0] == "bucketed"


def test_a_named_backend_that_cannot_load_fails_with_its_error():
    def broken():
        raise ImportError("no module named 'fast_kernels'")

    def register(register):
        register(ImplementationSpec(name="fast", load=broken))
        register(ImplementationSpec(name="needs", load=lambda: None,
                                    requires=("surely_not_installed_module",)))

    plugins = build_plugins(load_entry_points=False, extra_plugins=[(
        "p", _plugin(gem_register_attention_backends=register))])
    with pytest.raises(GemPluginError, match="attention 'fast' from p failed to load: no module"):
        plugins.resolve("attention", "fast", AutoContext(device="cpu"))
    with pytest.raises(GemPluginError, match="needs surely_not_installed_module"):
        plugins.resolve("attention", "needs", AutoContext(device="cpu"))


def test_device_capabilities_are_enforced():
    def register(register):
        register(ImplementationSpec(name="gpu-only", load=lambda: None, devices=("cuda",)))

    plugins = build_plugins(load_entry_points=False, extra_plugins=[(
        "p", _plugin(gem_register_attention_backends=register))])
    with pytest.raises(GemConfigError, match="'gpu-only' does not run on cpu; it supports cuda"):
        plugins.resolve("attention", "gpu-only", AutoContext(device="cpu"))


def test_gem_disable_plugins_environment(monkeypatch):
    def register(register):
        register(_spec("extra"))

    monkeypatch.setenv("GEM_DISABLE_PLUGINS", "extra_plugin, other")
    plugins = build_plugins(load_entry_points=False, extra_plugins=[(
        "extra_plugin", _plugin(gem_register_attention_backends=register))])
    assert "extra" not in plugins.registry("attention")


HOOKS = [name for name, fn in inspect.getmembers(hookspecs, inspect.isfunction)
         if name.startswith("gem_")]


def test_every_hookspec_is_documented_and_exercised():
    """Each hook has a contract docstring; each registration hook yields specs and each default
    hook answers with a registered name for a CPU and a multi-rank context."""
    assert len(HOOKS) == len(KINDS) + sum(1 for _, d in KINDS.values() if d)
    for name in HOOKS:
        doc = inspect.getdoc(getattr(hookspecs, name)) or ""
        assert len(doc) > 40, f"{name} has no contract docstring"
    plugins = build_plugins()
    for kind, (register_hook, default_hook) in KINDS.items():
        assert register_hook in HOOKS
        specs = plugins.registry(kind).specs()
        assert specs and all(spec.kind == kind for spec in specs)
        if default_hook is None:
            continue
        assert default_hook in HOOKS
        for context in (AutoContext(device="cpu"), AutoContext(device="cpu", world_size=4)):
            name, reason = plugins.default_for(kind, context)
            assert name in plugins.registry(kind), f"{default_hook} answered unknown {name!r}"
            assert reason


def test_listing_commands_and_plugins_imports_no_heavy_library():
    code = (
        "import sys\n"
        "from gem_core.cli.main import cli\n"
        "for args in (['--help'], ['plugins', '--json']):\n"
        "    try:\n"
        "        cli(args, standalone_mode=False)\n"
        "    except SystemExit:\n"
        "        pass\n"
        "heavy = ['triton', 'deepspeed', 'torchrec', 'torchao', 'fbgemm_gpu', 'pyarrow']\n"
        "print(sorted(m for m in heavy if m in sys.modules))\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip().splitlines()[-1] == "[]"
