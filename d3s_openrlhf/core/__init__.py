"""Pure-torch D3S/PODS algorithms: no OpenRLHF, Ray, DeepSpeed or vLLM imports."""
