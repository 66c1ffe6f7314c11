"""The model: architecture (from config.json), the Llama-family decoder, weight loading,
and the CPU linear layers it can be packed into."""
