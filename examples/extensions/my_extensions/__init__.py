"""A user's extensions of nemo_like, one file per kind, each registered where it is defined.

From this folder (``examples/extensions``)::

    uv run ../run_grpo_math.py --import my_extensions.soft_clip_loss loss_fn.policy_loss=soft_clip loss_fn.tau=0.5

``tests/functional/test_user_extensions.py`` runs all five at once through the CLI.
"""
