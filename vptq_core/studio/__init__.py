"""What the app is made of besides its layout: the event handlers (``handlers``), the settings form's logic
(``form``), what the page shows as text (``views``) and as figures (``plots``), the job queue and the
quantization task, estimates before a run, the model cache and chat sessions. May import anything in
``vptq_core``."""
