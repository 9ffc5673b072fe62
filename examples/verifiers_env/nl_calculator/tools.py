"""The calculator as an MCP tool server. verifiers starts it as ``python -m <this module>`` for each
rollout, so the module ends by serving."""

import verifiers.v1 as vf


class CalculatorToolset(vf.Toolset[vf.SharedToolsetConfig]):
    TOOL_PREFIX = None  # the model sees the bare tool name, ``add``

    @vf.tool
    def add(self, a: int, b: int) -> str:
        """Add two integers."""
        return str(a + b)


if __name__ == "__main__":
    CalculatorToolset.run()
