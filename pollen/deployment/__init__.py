"""Real processes: starting and stopping them, the SuperLink and SuperNodes of
`pollen deploy`, `pollen run`'s launcher, the warm ClientApp executor,
network shaping and FAB staging."""
