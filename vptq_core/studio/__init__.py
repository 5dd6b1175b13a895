"""What the app is made of besides its layout: the job queue and the quantization task, estimates before a
run, the model cache, chat sessions and plots. May import anything in ``vptq_core``."""
