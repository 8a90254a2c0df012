"""What is built on the engine: the OpenAI-compatible server and client, folder captioning, context fitting, caption
files."""
