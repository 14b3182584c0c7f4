"""The simulators the fire rule runs on (the contract suites' session-wide ones)."""

from tests.contract.conftest import mongosim_sharded_uri, mongosim_uri

__all__ = ["mongosim_sharded_uri", "mongosim_uri"]
