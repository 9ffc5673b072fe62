"""Agent programs for examples/run_grpo_agent.py (env.agent.fn: examples.agents.<module>:<function>)."""
