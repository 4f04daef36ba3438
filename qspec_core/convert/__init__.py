"""Making and reading converted model folders; GPTQ/AWQ checkpoint import and export."""
