"""The deployment config: one YAML file, loaded strictly into frozen dataclasses.

Every field has a one-line docstring (the string right below it) that says what it is and its unit; the
docs' config reference is generated from these. Loading is strict (pydantic checks the types, then
:func:`validate` the combinations): an unknown key, a wrong type or an impossible combination raises
:class:`ConfigError` naming the file, the key and the numbers, before anything starts. Cross-field checks that need the model's shape (heads vs tensor-parallel size, memory)
live in :mod:`raydeploy.plan`, which runs before any actor is placed.

Modules: `schema` (the sections, `ConfigError`), `load` (`load_config`, `config_from_dict`), `validate` (the
combinations) and `reference` (the generated docs).
"""


from raydeploy.config.load import config_from_dict, load_config
from raydeploy.config.reference import config_reference_markdown, field_docs
from raydeploy.config.schema import (
    DEFAULT_CONFIG_PATH,
    MESH_AXES,
    ClusterConfig,
    Config,
    ConfigError,
    EngineConfig,
    MeshConfig,
    ModelConfig,
    ReplicasConfig,
    SamplingDefaults,
    ServingConfig,
    resolve_mesh_axes,
)
from raydeploy.config.validate import validate

__all__ = [
    "DEFAULT_CONFIG_PATH", "MESH_AXES", "ClusterConfig", "Config", "ConfigError", "EngineConfig", "MeshConfig",
    "ModelConfig", "ReplicasConfig", "SamplingDefaults", "ServingConfig", "config_from_dict",
    "config_reference_markdown", "field_docs", "load_config", "resolve_mesh_axes", "validate",
]
