"""kvferry: prefill/decode-disaggregated LLM serving, shared core."""
