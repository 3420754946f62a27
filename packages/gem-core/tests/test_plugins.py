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


def _options_plugin(received: list):
    """A dense strategy with an options class, recording the options each method gets."""
    import attrs

    from gem_core.config.validators import at_least
    from gem_core.contracts import DenseSharding

    @attrs.frozen(kw_only=True)
    class MeshOptions:
        size: int = attrs.field(default=1, validator=at_least(1))
        """Ranks per mesh row."""

    class Recording(DenseSharding):
        def apply(self, model, *, ctx, make_optimizer, precision, options):
            received.append(("apply", options))
            return model

        def plan_estimate(self, facts, options):
            received.append(("plan_estimate", options))

    def register(register):
        register(ImplementationSpec(name="recording", load=Recording, options=MeshOptions))

    return MeshOptions, _plugin(gem_register_dense_sharding=register)


def test_plugin_options_are_structured_once_and_handed_typed_to_every_method():
    import torch

    from gem_core.config import load_config
    from gem_core.distributed import ParallelContext
    from gem_core.parallelize import parallelize
    from gem_core.train.backends import resolve_backends

    received: list = []
    options_class, plugin = _options_plugin(received)
    plugins = build_plugins(load_entry_points=False, extra_plugins=[("opts", plugin)])
    config = load_config(overrides=["backends.dense_sharding=recording", "parallel.dense.size=4"])
    ctx = ParallelContext()
    backends = resolve_backends(config, plugins, ctx)
    chosen = backends.dense_sharding.options
    assert chosen == options_class(size=4)
    parallelize(torch.nn.Linear(2, 2), ctx=ctx, precision=backends.precision,
                embedding_sharding=backends.embedding_sharding,
                activation_checkpointing=backends.activation_checkpointing,
                dense_sharding=backends.dense_sharding, make_optimizer=None, config=config)
    backends.dense_sharding.impl.plan_estimate(None, chosen)
    assert [name for name, _ in received] == ["apply", "plan_estimate"]
    assert all(options is chosen for _, options in received)  # the one instance, typed
    # The options of implementations that take none: None, and any key is refused.
    assert backends.embedding_sharding.options is None


def test_an_unknown_or_bad_plugin_option_is_refused_naming_its_full_key():
    from gem_core.config import load_config
    from gem_core.distributed import ParallelContext
    from gem_core.train.backends import resolve_backends

    _, plugin = _options_plugin([])
    plugins = build_plugins(load_entry_points=False, extra_plugins=[("opts", plugin)])

    def resolve(*overrides):
        config = load_config(overrides=["backends.dense_sharding=recording", *overrides])
        return resolve_backends(config, plugins, ParallelContext())

    with pytest.raises(GemConfigError, match="unknown key 'parallel.dense.sise'; allowed keys "
                                             "in parallel.dense: size"):
        resolve("parallel.dense.sise=2")
    with pytest.raises(GemConfigError, match="parallel.dense.size must be >= 1; got 0"):
        resolve("parallel.dense.size=0")
    with pytest.raises(GemConfigError, match="embedding_sharding 'replicated' takes no options; "
                                             "got plan"):
        resolve("parallel.embedding.plan={}")
    with pytest.raises(GemConfigError, match="unknown key 'data.options.num_itemz'"):
        resolve("data.options.num_itemz=3")
    with pytest.raises(GemConfigError, match="precision 'fp32' takes no options; got min_dim"):
        resolve("backends.precision=fp32", "precision.options.min_dim=16")


def test_options_must_be_an_attrs_class_of_a_kind_that_takes_options():
    def bad_class(register):
        register(ImplementationSpec(name="x", load=lambda: None, options=dict))

    def no_table(register):
        register(ImplementationSpec(name="x", load=lambda: None, options=AutoContext))

    with pytest.raises(GemPluginError, match="declare an attrs class"):
        build_plugins(load_entry_points=False, extra_plugins=[(
            "bad", _plugin(gem_register_dense_sharding=bad_class))])
    with pytest.raises(GemPluginError,
                       match="declares options, but attention implementations take none"):
        build_plugins(load_entry_points=False, extra_plugins=[(
            "bad", _plugin(gem_register_attention_backends=no_table))])
