"""The mixture-of-experts feature: the state, token dispatch, routing, load balancing and LoRA of
the expert modules that `fsdpturbo.ep` (the EP module surgery) parallelizes.

ep_state (an expert module's one state object), dispatch/ (the token dispatchers), ops (the
MoE ops' autograd and fakes), expert_stats (the routes' one tally), router_replay and recompute
(routes that stay put under activation checkpointing), balance (aux and z-loss), expert_bias
(aux-loss-free balancing) and expert_lora (PEFT's expert adapters in the experts' layout). The
public functions are exported by `fsdpturbo` itself.
"""
