"""Downstream evaluation: lm-evaluation-harness scoring megatron_lite checkpoints.

    harness_model.py   the `megatron_lite` model of lm-eval (loglikelihood, rolling, generate_until)

tools/run_lm_eval.py runs lm-eval's command line with it registered. lm-eval is an optional dependency
(`pip install -e ".[eval]"`); nothing else in the package imports this one.
"""
