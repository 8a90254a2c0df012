// A3B nodes: shows the Loader's placement plan, the Generate node's answer (live while it streams) with the run's
// speed line under it, what Save Captions and Caption Folder wrote, and what each clip of Video Encode costs in tokens.
// The server sends the live text as ComfyUI "progress_text" messages, the plan as an "a3b.plan" message each time a
// node uses the model (a cached Loader sends nothing itself), and the rest as the nodes' ui outputs (a3b_answer,
// a3b_speed, a3b_saved, a3b_tokens).
import { app } from "../../../scripts/app.js";
import { api } from "../../../scripts/api.js";

// ComfyUI's own frontend (1.2x+) already renders progress_text into this widget; where it exists we leave the live
// text to it and only set the final answer, so the text is never shown twice.
const NATIVE_TEXT_PREVIEW = "$$node-text-preview";

function textPanel(node, name, rows) {
  const existing = node.widgets?.find((w) => w.name === name);
  if (existing) return existing;
  const element = document.createElement("textarea");
  element.readOnly = true;
  element.rows = rows;
  element.className = "a3b-text-panel";
  Object.assign(element.style, {
    width: "100%", boxSizing: "border-box", resize: "vertical", fontFamily: "monospace", fontSize: "11px",
    background: "var(--comfy-input-bg, #222)", color: "var(--input-text, #ddd)", border: "none", borderRadius: "4px",
  });
  const widget = node.addDOMWidget(name, "a3b_text", element, {
    serialize: false, // display only: never part of the saved workflow or the prompt
    getValue: () => element.value,
    setValue: (value) => { element.value = value; },
  });
  widget.a3bElement = element;
  return widget;
}

function showText(node, name, text, rows = 6) {
  const widget = textPanel(node, name, rows);
  widget.a3bElement.value = text;
  widget.a3bElement.scrollTop = widget.a3bElement.scrollHeight;
  node.setDirtyCanvas?.(true, true);
}

function showAnswer(node, text) {
  const native = node.widgets?.find((w) => w.name === NATIVE_TEXT_PREVIEW);
  if (native) {
    native.value = text;
    node.setDirtyCanvas?.(true, true);
  } else {
    showText(node, "a3b_answer", text, 8);
  }
}

// A short status text (the speed line), wrapped over up to three lines; created after the answer's widget, so it
// sits under it.
function showLine(node, name, text) {
  let widget = node.widgets?.find((w) => w.name === name);
  if (!widget) {
    const element = document.createElement("div");
    element.className = "a3b-line";
    Object.assign(element.style, {
      fontFamily: "monospace", fontSize: "11px", lineHeight: "14px", color: "var(--descrip-text, #999)",
      overflow: "hidden", padding: "2px 4px", boxSizing: "border-box",
    });
    widget = node.addDOMWidget(name, "a3b_line", element, {
      serialize: false, // display only: never part of the saved workflow or the prompt
      getValue: () => element.textContent,
      setValue: (value) => { element.textContent = value; },
      getMinHeight: () => 32,
      getMaxHeight: () => 46,
    });
    widget.a3bElement = element;
  }
  widget.a3bElement.textContent = text;
  node.setDirtyCanvas?.(true, true);
}

function onLiveText(event) {
  const { nodeId, text } = event.detail ?? {};
  const node = app.graph?.getNodeById(nodeId);
  const panel = { A3BGenerate: ["a3b_answer", 8], A3BCaptionFolder: ["a3b_saved", 4] }[node?.comfyClass];
  if (!panel) return;
  // Run after every other listener, so a native text preview (if this frontend has one) exists by then; the node's
  // results may arrive in that time (the last live text comes right before them), and then they stay.
  const results = node.a3bResults ?? 0;
  setTimeout(() => {
    if ((node.a3bResults ?? 0) !== results) return;
    if (!node.widgets?.some((w) => w.name === NATIVE_TEXT_PREVIEW)) showText(node, panel[0], text, panel[1]);
  }, 0);
}

function onPlan(event) {
  const { node: nodeId, summary, table } = event.detail ?? {};
  const node = app.graph?.getNodeById(nodeId);
  if (node?.comfyClass !== "A3BModelLoader") return;
  showText(node, "a3b_plan", summary, 3);
  textPanel(node, "a3b_plan", 3).a3bElement.title = table; // the full placement table on hover
}

app.registerExtension({
  name: "a3b.nodes",

  setup() {
    api.addEventListener("progress_text", onLiveText);
    api.addEventListener("a3b.plan", onPlan);
  },

  async beforeRegisterNodeDef(nodeType, nodeData) {
    if (!["A3BGenerate", "A3BSaveCaptions", "A3BCaptionFolder", "A3BVideoEncode"].includes(nodeData.name)) return;
    const onExecuted = nodeType.prototype.onExecuted;
    nodeType.prototype.onExecuted = function (message) {
      onExecuted?.apply(this, arguments);
      this.a3bResults = (this.a3bResults ?? 0) + 1; // results shown so far: a pending live text must not cover them
      if (message?.a3b_answer) showAnswer(this, message.a3b_answer.join("\n\n"));
      if (message?.a3b_speed) showLine(this, "a3b_speed", message.a3b_speed.join(" "));
      if (message?.a3b_saved) showText(this, "a3b_saved", message.a3b_saved.join("\n"), 4);
      if (message?.a3b_tokens) showText(this, "a3b_tokens", message.a3b_tokens.join("\n"), 2);
    };
  },
});
