"""Trajectory-level GRPO (and PPO with a value head) for agents on gymnasium-style step environments.

- ``config``: the typed config (``examples/configs/grpo_cartpole.yaml``);
- ``experiment``: ``GymGRPOExperiment``, the notebook API;
- ``trainer``: the update (collect groups of episodes from one reset seed, advantages, the loss);
- ``setup``: ``setup_gym``, which builds a trainer (checks, Ray, collectors, network, resume);
- ``collector``: the collector actors that step the environments in lockstep;
- ``step_env``: the ``StepEnvironment`` contract, its registry and the gymnasium adapter;
- ``catch``: an image task for the CNN;
- ``agent``: the actor-critic networks and their registry;
- ``loss``: the trajectory policy-gradient loss and the value term.

Kept import-light: importing ``nemo_like.gym`` loads none of these.
"""
