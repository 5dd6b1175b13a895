"""The Chat tab's divergence section: a text (pasted, an uploaded .txt or the last chat answer) compared under the
run picked above, token by token, streamed as coloured HTML with a Stop and an HTML download; and its events."""

from __future__ import annotations

import gradio as gr

from ..divergence_html import PLACE_JS
from .divergence_handlers import EMPTY
from .ui_page import Page
from .zerogpu import on_gpu


def divergence_section(page: Page) -> None:
    settings = page.settings
    limit = settings.max_divergence_tokens
    with gr.Accordion("Divergence: where the quantized model departs from the original, token by token", open=True,
                      elem_id="div-section"):
        gr.Markdown(f"Both models read the same text; each token is coloured by KL(original ‖ quantized) of their "
                    f"predictions of it, underlined where their top-1 next token differs. At most {limit} tokens "
                    f"and {settings.divergence_time_limit_s:g} s per comparison.", elem_classes="vq-note")
        with gr.Row(equal_height=True):
            div_text = gr.Textbox(label="Text to compare the models on", lines=4, max_lines=10, scale=4,
                                  max_length=settings.max_divergence_text_bytes, elem_id="div-text")
            with gr.Column(scale=1, min_width=220):
                div_upload = gr.UploadButton("Upload a .txt", file_types=[".txt"], size="sm", elem_id="div-upload")
                div_from_orig = gr.Button("Last answer of the original", size="sm", elem_id="div-from-original")
                div_from_quant = gr.Button("Last answer of the quantized", size="sm", elem_id="div-from-quantized")
        with gr.Row(equal_height=True):
            div_tokens = gr.Slider(16, limit, value=min(512, limit), step=16, label="max tokens", scale=3,
                                   elem_id="div-tokens")
            div_btn = gr.Button("Compare", variant="primary", scale=1, elem_id="div-compare")
            div_stop = gr.Button("Stop", variant="stop", scale=1, elem_id="div-stop")
            div_download = gr.DownloadButton("Download the HTML", visible=False, scale=1, elem_id="div-download")
        div_status = gr.Markdown(elem_id="div-status", elem_classes="vq-stats")
        div_view = gr.HTML(EMPTY, elem_id="div-view", js_on_load=PLACE_JS, min_height=60)
    page.update(div_text=div_text, div_upload=div_upload, div_from_orig=div_from_orig, div_from_quant=div_from_quant,
                div_tokens=div_tokens, div_btn=div_btn, div_stop=div_stop, div_download=div_download,
                div_status=div_status, div_view=div_view)


def wire_divergence(page: Page) -> None:
    p, handlers = page, page.studio.divergence
    p.div_upload.upload(handlers.read_upload, inputs=p.div_upload, outputs=p.div_text, api_name="divergence_upload",
                        show_progress="hidden")
    p.div_from_orig.click(handlers.last_answer, inputs=p.chat_orig, outputs=p.div_text, api_visibility="private",
                          show_progress="hidden")
    p.div_from_quant.click(handlers.last_answer, inputs=p.chat_quant, outputs=p.div_text, api_visibility="private",
                           show_progress="hidden")
    p.div_btn.click(on_gpu(handlers.compute, 120), inputs=[p.div_text, p.chat_run, p.div_tokens],
                    outputs=[p.div_view, p.div_download, p.div_status], api_name="divergence",
                    concurrency_limit=p.settings.chat_concurrency, concurrency_id="divergence",
                    show_progress="hidden")
    p.div_stop.click(handlers.stop, api_name="divergence_stop", concurrency_limit=None)
