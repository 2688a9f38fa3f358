"""One replica over several devices: tensor-parallel attention and expert-parallel MoE.

`spec` says what each rank holds, `comm` the process groups, `layers` the rank's model,
`loader` the sharded streaming load, `step` rank 0's per-step broadcast, `worker` a rank
other than 0, `gang` the placement group and actors, `launch` how `Engine.from_pretrained`
puts them together.
"""
