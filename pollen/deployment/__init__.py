"""Real processes: pollen's warm ClientApp executor (`pollen superexec`).

The rest of deployment (SuperLink/SuperNode management, certificates,
network shaping, FAB staging) still lives in `pollen.deploy`,
`pollen.network` and `pollen.fab`; they move here with the core's reshaping.
"""
