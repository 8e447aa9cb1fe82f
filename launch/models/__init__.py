"""The run's model: loco's Llama-style decoder, any ``transformers`` causal LM; ``hf/`` moves weights in
and out of Hugging Face folders."""
