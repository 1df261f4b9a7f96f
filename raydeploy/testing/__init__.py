"""Test doubles that must run inside Ray workers, and so ship with the package: the stand-in engine
(`toy`, also behind `--engine toy` to smoke-test a cluster without weights), fault injection (`faults`, an engine
source wrapping a factory) and paged plans on fixed page runs for engine checks and benchmarks (`plans`).

The serving path never imports this package: a gang gets the stand-in engine only through its engine
factory (raydeploy.gang.runtime.ENGINES) and faults only when a test wraps the factory with them.
"""
