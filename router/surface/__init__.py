"""The OpenAI surface: request bodies, chat templates, tools and structured outputs in; text, chunks and bodies out."""
