"""The Chat tab: pick a run or upload a packed checkpoint, evaluate it, and chat with two models side by side (each
side the original or any finished run, with its own Stop); and its events."""

from __future__ import annotations

import gradio as gr

from . import views
from .chat_history import bound_history
from .ui_page import Page
from .zerogpu import on_gpu

SIDE_ORIGINAL = [("Original model (of the run picked above)", "original")]


def chat_tab(page: Page, examples: list[list[str]]) -> None:
    """The tab's layout; ``examples``: prompts offered under the prompt box (one per row)."""
    settings = page.settings
    upload_row(page)
    with gr.Row(equal_height=False, elem_classes="vq-eval-row"):
        models_box = gr.Markdown(views.NO_RUN, elem_id="chat-models")
        run_eval_btn = gr.Button("Evaluate this run vs the original", size="md", scale=0, min_width=260,
                                 elem_id="chat-eval-btn")
    run_eval_box = gr.Markdown(elem_id="chat-eval-result", min_height=40)
    gr.Markdown(views.CHAT_SPEED_NOTE, elem_classes="vq-note", elem_id="chat-speed-note")
    with gr.Row(equal_height=True):
        with gr.Column(elem_classes="vq-chat-col"):
            chat_left = gr.Dropdown(SIDE_ORIGINAL, value="original", label="Left side", elem_id="chat-left")
            chat_orig = gr.Chatbot(label="Original model", show_label=False, height=380, elem_id="chat-original",
                                   buttons=["copy"])
            stats_orig = gr.Markdown(elem_classes="vq-stats", elem_id="stats-original")
            stop_orig_btn = gr.Button("Stop the left side", size="sm", elem_id="chat-stop-original")
        with gr.Column(elem_classes="vq-chat-col"):
            chat_right = gr.Dropdown(SIDE_ORIGINAL, value="", label="Right side (follows the run picked above)",
                                     allow_custom_value=True, elem_id="chat-right")
            chat_quant = gr.Chatbot(label="Quantized model", show_label=False, height=380, elem_id="chat-quantized",
                                    buttons=["copy"])
            stats_quant = gr.Markdown(elem_classes="vq-stats", elem_id="stats-quantized")
            stop_quant_btn = gr.Button("Stop the right side", size="sm", elem_id="chat-stop-quantized")
    for chatbot in (chat_orig, chat_quant):
        bound_history(chatbot, settings.max_chat_messages)
    with gr.Row(equal_height=True):
        prompt = gr.Textbox(placeholder=f"Ask both models something… (at most {settings.max_prompt_tokens} tokens "
                                        "with the conversation)",
                            show_label=False, scale=5, elem_id="chat-prompt", max_lines=4,
                            max_length=4 * settings.max_prompt_tokens)
        send_btn = gr.Button("Send", variant="primary", scale=1, elem_id="chat-send")
        stop_btn = gr.Button("Stop both", variant="stop", scale=1, elem_id="chat-stop")
        clear_btn = gr.Button("Clear", scale=1, elem_id="chat-clear")
    with gr.Accordion("Sampling", open=False):
        with gr.Row():
            temperature = gr.Slider(0.0, 2.0, value=0.0, step=0.05, label="temperature (0 = greedy)",
                                    elem_id="chat-temperature")
            top_p = gr.Slider(0.05, 1.0, value=0.95, step=0.05, label="top-p")
            max_new_tokens = gr.Slider(1, 1024, value=64 if page.small else 160, step=1, label="max new tokens",
                                       elem_id="chat-max-tokens")
            seed = gr.Number(0, precision=0, minimum=0, label="seed (both sides)", elem_id="chat-seed")
    if examples:
        gr.Examples(examples, inputs=[prompt], label="Example prompts")
    page.update(models_box=models_box, run_eval_btn=run_eval_btn, run_eval_box=run_eval_box, chat_orig=chat_orig,
                stats_orig=stats_orig, stop_orig_btn=stop_orig_btn, chat_quant=chat_quant, stats_quant=stats_quant,
                stop_quant_btn=stop_quant_btn, prompt=prompt, send_btn=send_btn, stop_btn=stop_btn,
                clear_btn=clear_btn, temperature=temperature, top_p=top_p, max_new_tokens=max_new_tokens,
                chat_left=chat_left, chat_right=chat_right, chat_seed=seed)


def upload_row(page: Page) -> None:
    """The run picker and the archive upload next to it."""
    with gr.Row(equal_height=True):
        chat_run = gr.Dropdown([], value=None, label="Quantized run", allow_custom_value=True, scale=3,
                               elem_id="chat-run")
        archive_upload = gr.File(label="…or load a packed checkpoint (.zip)", file_types=[".zip"], scale=2,
                                 height=110, elem_id="archive-upload")
    page.update(chat_run=chat_run, archive_upload=archive_upload)


def wire_upload(page: Page) -> None:
    """An upload is checked and unpacked first (no outputs, so a refusal marks nothing), then shown."""
    p, uploads = page, page.studio.uploads
    uploaded = p.archive_upload.upload(uploads.upload_run, inputs=p.archive_upload, outputs=p.upload_state,
                                       api_visibility="private", concurrency_limit=2, show_progress="hidden")
    uploaded.success(uploads.upload_view, inputs=p.upload_state,
                     outputs=[p.chat_run, p.models_box, p.runs_table, p.runs_plot, p.delete_pick, p.archive_upload,
                              p.guard], api_visibility="private", show_progress="hidden")
    uploaded.failure(lambda: None, outputs=p.archive_upload, api_visibility="private", show_progress="hidden")
    p.upload_api.click(uploads.upload, inputs=p.archive_upload,
                       outputs=[p.chat_run, p.models_box, p.runs_table, p.runs_plot], api_name="upload",
                       concurrency_limit=2)


def wire_chat(page: Page) -> None:
    """Evaluating the picked run, loading its models, the chat on both sides, stop and clear."""
    p, studio, chat = page, page.studio, page.studio.chat
    p.run_eval_btn.click(on_gpu(studio.evaluation.evaluate_run, 300), inputs=[p.chat_run, p.eval_windows,
                         p.eval_seqlen], outputs=[p.run_eval_box, p.runs_table, p.runs_plot], api_name="evaluate_run",
                         concurrency_limit=1, concurrency_id="evaluate", show_progress_on=[p.run_eval_box])
    sides, load_outputs = [p.chat_left, p.chat_right], [p.models_box, p.chat_orig, p.chat_quant, p.stats_orig,
                                                         p.stats_quant]
    # The right side follows the run picked above; either side can be set to the original or any finished run.
    p.chat_run.change(chat.follow_run, inputs=[p.chat_run, *sides], outputs=sides, api_visibility="private",
                      show_progress="hidden").then(
        chat.load_sides, inputs=[p.chat_run, *sides], outputs=load_outputs, api_name="chat_load",
        concurrency_limit=2)
    gr.on([p.chat_left.input, p.chat_right.input], chat.load_sides, inputs=[p.chat_run, *sides],
          outputs=load_outputs, api_visibility="private", concurrency_limit=2)
    gr.on([p.runs_table.change, p.demo.load], chat.refresh_sides, inputs=sides, outputs=sides,
          api_visibility="private", show_progress="hidden")
    p.chat_run.change(studio.evaluation.picked_view, inputs=p.chat_run, outputs=p.run_eval_box,
                      api_visibility="private", show_progress="hidden")
    chat_inputs = [p.prompt, p.chat_orig, p.chat_quant, p.chat_run, p.temperature, p.top_p, p.max_new_tokens,
                   *sides, p.chat_seed]
    chat_outputs = [p.chat_orig, p.chat_quant, p.stats_orig, p.stats_quant, p.prompt]
    gr.on([p.send_btn.click, p.prompt.submit], on_gpu(chat.reply_sides, 120), inputs=chat_inputs, outputs=chat_outputs,
          api_name="chat", concurrency_limit=p.settings.chat_concurrency, concurrency_id="chat",
          show_progress="hidden")
    p.stop_btn.click(chat.stop_both, api_name="chat_stop", concurrency_limit=None)
    p.stop_orig_btn.click(chat.stop_original, api_name="chat_stop_original", concurrency_limit=None)
    p.stop_quant_btn.click(chat.stop_quantized, api_name="chat_stop_quantized", concurrency_limit=None)
    p.clear_btn.click(chat.clear, outputs=[p.chat_orig, p.chat_quant, p.stats_orig, p.stats_quant],
                      api_name="chat_clear")
