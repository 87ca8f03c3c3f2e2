"""Target backends: who computes the target's logits. `torch` (spekit.backends.torch_target: Hugging Face forwards with 4-D masks,
the exact reference) and `llama.cpp` (spekit.backends.llama_cpp: GGUF files through llama-cpp-python, quantized as
they ship). The engine, the acceptance rule, the proposers and the cost model see one target interface."""
