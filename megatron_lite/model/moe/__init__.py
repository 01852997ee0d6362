"""Mixture-of-Experts: router -> token dispatcher -> local experts -> dispatcher back.

    layer.py             MoELayer, its metrics and the step's auxiliary losses
    router.py            top-k gating and the balancing losses
    token_dispatcher.py  all-to-all and all-gather dispatchers over the expert-parallel group
    experts.py           the local routed experts (grouped or sequential) and the shared expert
"""
