"""From files to token ids: the readers of every input form (``formats``, strict JSON in
``json_text``), the dataset partitions and the held-out split (``datasets``), the built-in
``python_stdlib`` pool (``stdlib_dataset``), chat-template rendering, masking and truncation
(``tokenization``) and padding-free batch layout (``packing``). Imports only ``storage``.
"""
