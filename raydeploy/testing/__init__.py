"""Test doubles that must run inside Ray workers, and so ship with the package: the stand-in engine
(`toy`, also behind `--engine toy` to smoke-test a cluster without weights) and fault injection (`faults`).

The serving path never imports this package: a gang gets the stand-in engine only through its engine
factory (raydeploy.gang.runtime.ENGINES) and faults only when a test passes them.
"""
