"""`wait_rank` and `HPAgentK8sAPIFactory` at the product note's path (the implementations:
hyperpodrun/runtime/wrapper.py and hyperpodrun/runtime/agent_channel.py)."""
from hyperpodrun.runtime.agent_channel import HPAgentK8sAPIFactory
from hyperpodrun.runtime.wrapper import wait_rank

__all__ = ["wait_rank", "HPAgentK8sAPIFactory"]
