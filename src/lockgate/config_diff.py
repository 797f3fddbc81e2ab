"""What a reload changes: a pure comparison of the running configuration with a new one.

`plan_reload()` builds the configuration a reload would serve: the new file's hot sections (`models`,
`tenants`, `admin`) over the running configuration, every other section kept as it runs (a change there is
listed in `restart_required` and is not applied: the listening socket, the edge limits, the usage
database, the simulators, ... are set up once at start). `diff_configs()` then says which instances,
models and tenants differ; `Gateway.reconfigure()` applies that. Nothing here does I/O.

Instances are identified by URL (one engine process, whichever models list it). An instance whose URL
stays but whose settings change (engine, name, key, concurrency) is replaced: the running object
retires (no new requests; closed once its requests end) and a new one takes its place.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from pydantic import ValidationError

from .config import Config, ConfigError, InstanceConfig, ModelConfig, describe_validation_error
from .embedded import with_instances

#: Sections a reload applies; a change anywhere else needs a restart.
HOT_SECTIONS = frozenset({"models", "tenants", "admin"})


@dataclass(frozen=True, slots=True)
class ConfigDiff:
    #: Instance keys (URLs).
    added_instances: tuple[str, ...] = ()
    removed_instances: tuple[str, ...] = ()
    #: Same URL, other settings: the running instance retires, a new one replaces it.
    changed_instances: tuple[str, ...] = ()
    #: Model names; a changed model gets a new pool (settings or members differ).
    added_models: tuple[str, ...] = ()
    removed_models: tuple[str, ...] = ()
    changed_models: tuple[str, ...] = ()
    tenants_changed: bool = False
    #: The admin keys (or `metrics_require_key`) differ: a reload that adds tenant keys can add the admin key that
    #: keeps the operator routes open to their operator (with `admin` applied only at a restart, that reload locked
    #: the operator out of `/admin/reload` itself).
    admin_changed: bool = False
    #: Keys changed in the file but kept as they run until a restart.
    restart_required: tuple[str, ...] = ()
    #: Instance key -> display name (the new one where both configurations list it).
    instance_names: Mapping[str, str] = field(default_factory=dict, compare=False)
    #: Instance key -> its name in the running configuration, for those a reload replaces under another name.
    former_names: Mapping[str, str] = field(default_factory=dict, compare=False)

    @property
    def applies_nothing(self) -> bool:
        return not (
            self.added_instances
            or self.removed_instances
            or self.changed_instances
            or self.added_models
            or self.removed_models
            or self.changed_models
            or self.tenants_changed
            or self.admin_changed
        )

    def shown(self, keys: tuple[str, ...]) -> list[str]:
        """Instances' keys as their names."""
        return [self.instance_names.get(key, key) for key in keys]

    def replaced_names(self) -> list[tuple[str | None, str]]:
        """Each replaced instance's former name (None: the same) and its name now."""
        return [(self.former_names.get(key), self.instance_names.get(key, key)) for key in self.changed_instances]

    def describe(self) -> dict[str, object]:
        """JSON-ready, instances shown by name."""
        shown = self.shown

        return {
            "instances": {
                "added": shown(self.added_instances),
                "removed": shown(self.removed_instances),
                "replaced": shown(self.changed_instances),
                # (An outside run: a reload that swapped two names read as two instances replaced, nothing renamed.)
                "renamed": {
                    self.former_names[key]: shown((key,))[0]
                    for key in self.changed_instances
                    if key in self.former_names
                },
            },
            "models": {
                "added": list(self.added_models),
                "removed": list(self.removed_models),
                "changed": list(self.changed_models),
            },
            "tenants_changed": self.tenants_changed,
            "admin_changed": self.admin_changed,
            "restart_required": list(self.restart_required),
        }


@dataclass(frozen=True, slots=True)
class ReloadPlan:
    #: What to serve (simulators expanded, command-line overrides kept).
    served: Config
    #: The file as applied: the new hot sections over the running file (the next reload's baseline).
    applied_file: Config
    #: Keys changed in the file but kept as they run until a restart.
    restart_required: tuple[str, ...]


def plan_reload(
    running_file: Config, new_file: Config, served: Config, simulated: Mapping[str, list[InstanceConfig]]
) -> ReloadPlan:
    """The configuration to serve after a reload, and the changed keys it does not apply.

    `running_file` is the file as loaded at start (or by the last reload), `new_file` the file now,
    `served` what runs (simulators expanded, command-line overrides applied) and `simulated` the
    instances the running simulators add. Raises `ConfigError` if the new hot sections do not fit the
    sections that stay (a tenant naming a priority class only the new file defines, ...)."""
    restart = [
        name
        for name in type(new_file).model_fields
        if name not in HOT_SECTIONS and _differs(running_file, new_file, name)
    ]
    old_models = {m.name: m for m in served.models}
    models: list[ModelConfig] = []
    for model in new_file.models:
        old = old_models.get(model.name)
        semantic = old.semantic if old is not None else None
        # The semantic cache (and its embedding model) is set up at start, for a model that de-duplicates: a change
        # of either that would need one where none runs (or the other way) needs a restart. A model added by a
        # reload gets none (one removed and added again lost its cache with it).
        running = semantic is not None and old is not None and old.dedup != "off"
        wanted = model.semantic is not None and model.dedup != "off"
        if model.semantic != semantic or running != wanted:
            restart.append(f"models[{model.name}].semantic")
            model = model.model_copy(update={"semantic": semantic})
        models.append(model)
    merged = running_file.model_copy(update={"models": models, "tenants": new_file.tenants, "admin": new_file.admin})
    try:
        # Revalidate the combination (cross-section rules: tenants vs classes, models vs simulators).
        merged = Config.model_validate(merged.model_dump())
    except ValidationError as exc:
        raise ConfigError(describe_validation_error(exc, "the new configuration with the running settings")) from None
    expanded = with_instances(merged, simulated)
    listed = {model.name for model in new_file.models}
    served_models = []
    for model in expanded.models:
        old = old_models.get(model.name)
        if model.name not in listed and old is not None and old.semantic is not None and model.semantic is None:
            # Gone from `models:` but still served by the simulators: its cache runs on until a restart (an outside
            # run: the reload said nothing, and reloading the file it started with then reported a change).
            restart.append(f"models[{model.name}].semantic")
            model = model.model_copy(update={"semantic": old.semantic})
        served_models.append(model)
    return ReloadPlan(
        served=served.model_copy(update={"models": served_models, "tenants": merged.tenants, "admin": merged.admin}),
        applied_file=merged,
        restart_required=tuple(restart),
    )


def _differs(a: Config, b: Config, section: str) -> bool:
    return bool(getattr(a, section) != getattr(b, section))


def instance_specs(config: Config) -> dict[str, InstanceConfig]:
    """Each instance's settings by key: the first model listing a URL defines it (as `Fleet` does)."""
    specs: dict[str, InstanceConfig] = {}
    for model in config.models:
        for spec in model.instances:
            specs.setdefault(spec.key, spec)
    return specs


def _engine_settings(spec: InstanceConfig) -> InstanceConfig:
    """What makes the engine object: everything but `served_model` (a per-model setting)."""
    return spec.model_copy(update={"served_model": None})


def diff_configs(old: Config, new: Config, restart_required: tuple[str, ...] = ()) -> ConfigDiff:
    """What differs between two served configurations (simulators expanded)."""
    old_specs, new_specs = instance_specs(old), instance_specs(new)
    added = tuple(k for k in new_specs if k not in old_specs)
    removed = tuple(k for k in old_specs if k not in new_specs)
    changed = tuple(
        k for k in new_specs if k in old_specs and _engine_settings(old_specs[k]) != _engine_settings(new_specs[k])
    )
    replaced = set(changed)
    old_models = {m.name: m for m in old.models}
    new_models = {m.name: m for m in new.models}
    return ConfigDiff(
        added_instances=added,
        removed_instances=removed,
        changed_instances=changed,
        added_models=tuple(n for n in new_models if n not in old_models),
        removed_models=tuple(n for n in old_models if n not in new_models),
        changed_models=tuple(
            name
            for name, model in new_models.items()
            if name in old_models and (model != old_models[name] or any(i.key in replaced for i in model.instances))
        ),
        tenants_changed=old.tenants != new.tenants,
        admin_changed=old.admin != new.admin,
        restart_required=restart_required,
        instance_names={key: spec.display_name for key, spec in (*old_specs.items(), *new_specs.items())},
        former_names={
            key: old_specs[key].display_name
            for key in changed
            if old_specs[key].display_name != new_specs[key].display_name
        },
    )
