"""Integrations of memattn with other libraries; each is imported on its own and needs that
library installed. None is imported here, so ``import memattn`` never needs them.

``memattn.integrations.transformers``: Hugging Face transformers (the optional extra
``memattn[transformers]``). Importing it registers ``attn_implementation="memattn"``::

    import memattn.integrations.transformers  # registers "memattn"
    model = AutoModelForCausalLM.from_pretrained(path, attn_implementation="memattn")
"""
