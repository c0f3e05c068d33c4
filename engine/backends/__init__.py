"""External serving engines (SGLang, vLLM) and one benchmark client for every OpenAI-compatible endpoint."""
