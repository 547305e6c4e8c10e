"""One folder per architecture (layer 4). Each defines ``SPEC`` (a ``FamilySpec``);
``implicit_attn.registry`` lists them."""
