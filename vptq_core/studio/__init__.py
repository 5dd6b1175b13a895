"""The app (``app.py`` is its entry point). The page: ``ui`` lays it out and wires it, one ``ui_*`` module per
part. The handlers: ``handlers.Studio`` composes one group per concern (``session``, ``quantize_form``, ``runs``,
``downloads``, ``evaluation``, ``hub``, ``uploads``, ``chat_handlers``) over the services they share
(``services``, ``run_models``). Background jobs: ``queue`` (the manager), ``job`` (one job), ``jobstore`` (what
survives a restart), ``task`` (the quantization job), ``zerogpu``. Besides: the settings form's logic
(``form``), what the page shows as text (``views``) and as figures (``plots``), estimates before a run
(``estimate``), the model cache, chat sessions (``chat``) and model cards (``card``). May import anything in
``vptq_core``."""
