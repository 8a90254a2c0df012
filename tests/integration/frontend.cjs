// Drives ComfyUI's real frontend in headless Chromium (playwright-core, Debian's /usr/bin/chromium).
//
//   node frontend.cjs check URL OUT_DIR EDITS convert|run WORKFLOW.json...
//       load each UI workflow, edit it as EDITS says ({"widgets": {"NodeClass": {"widget": value}}, "previews":
//       [["NodeClass", output slot], ...]}: set widgets; wire a Preview as Text node to each output named), convert
//       it with app.graphToPrompt() and, with 'run', queue it, wait for it, read what the nodes show and take a
//       screenshot; prints a JSON report
//   node frontend.cjs build URL WORKFLOWS_DIR SPECS.json          build UI workflows, and their API copies in
//                                                                  WORKFLOWS_DIR/api, from node specs
//
// A3B_PLAYWRIGHT names the playwright-core module to load (it lives in a cache folder, not in the repository).
const fs = require("fs");
const path = require("path");
const { chromium } = require(process.env.A3B_PLAYWRIGHT || "playwright-core");

const CHROMIUM_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic",
  "--disable-background-networking", "--disable-component-update", "--disable-sync", "--no-first-run"];
const RUN_TIMEOUT_MS = 300_000;

async function openComfy(url) {
  // Without this a templates dialog covers the canvas on first start.
  await fetch(`${url}/settings`, { method: "POST", body: JSON.stringify({ "Comfy.TutorialCompleted": true }) });
  const browser = await chromium.launch({ executablePath: "/usr/bin/chromium", args: CHROMIUM_FLAGS });
  const page = await browser.newPage({ viewport: { width: 1600, height: 1000 } });
  const pageErrors = [];
  // Errors raised by the pack's own script (the page's blocked calls to api.comfy.org are expected offline).
  const ours = (where) => String(where ?? "").includes("/extensions/a3b_nodes/");
  page.on("pageerror", (error) => { if (ours(error.stack)) pageErrors.push(String(error.stack)); });
  page.on("console", (msg) => {
    if (msg.type() === "error" && ours(msg.location()?.url)) pageErrors.push(msg.text());
  });
  await page.goto(url);
  await page.waitForFunction(() => window.app?.extensions?.some((e) => e.name === "a3b.nodes"), null,
    { timeout: 120_000 });
  // Collect the live text messages the server streams, per node.
  await page.evaluate(() => {
    window.__a3bLive = [];
    window.app.api.addEventListener("progress_text", (e) => window.__a3bLive.push(e.detail));
  });
  return { browser, page, pageErrors };
}

async function waitForHistory(url, promptId) {
  const deadline = Date.now() + RUN_TIMEOUT_MS;
  while (Date.now() < deadline) {
    const history = await (await fetch(`${url}/history/${promptId}`)).json();
    if (history[promptId]) return history[promptId];
    await new Promise((resolve) => setTimeout(resolve, 250));
  }
  throw new Error(`prompt ${promptId} did not finish in ${RUN_TIMEOUT_MS} ms`);
}

async function check(url, outDir, edits, run, workflowPaths) {
  const { browser, page, pageErrors } = await openComfy(url);
  const report = { workflows: [], pageErrors };
  for (const file of workflowPaths) {
    const name = path.basename(file, ".json");
    const workflow = JSON.parse(fs.readFileSync(file, "utf8"));
    const apiPrompt = await page.evaluate(async ({ workflow, edits }) => {
      const app = window.app;
      await app.loadGraphData(workflow);
      for (const node of app.graph.nodes) {
        for (const [name, value] of Object.entries(edits.widgets?.[node.comfyClass] ?? {})) {
          node.widgets.find((w) => w.name === name).value = value;
        }
      }
      for (const [type, slot] of edits.previews ?? []) {
        for (const node of app.graph.nodes.filter((n) => n.comfyClass === type)) {
          const preview = LiteGraph.createNode("PreviewAny");
          preview.pos = [node.pos[0] + node.size[0] + 40, node.pos[1] + 200 * slot];
          app.graph.add(preview);
          node.connect(slot, preview, 0);
        }
      }
      return (await app.graphToPrompt()).output;
    }, { workflow, edits });
    const entry = { name, apiPrompt };
    report.workflows.push(entry);
    if (run) {
      Object.assign(entry, await runLoadedWorkflow(url, page, apiPrompt));
      await page.evaluate(() => window.app.extensionManager.command.execute("Comfy.Canvas.FitView"));
      await page.waitForTimeout(300);
      entry.screenshot = path.join(outDir, `${name}.png`);
      await page.screenshot({ path: entry.screenshot });
    }
  }
  await browser.close();
  return report;
}

async function runLoadedWorkflow(url, page, apiPrompt) {
  const queued = await page.evaluate(async (apiPrompt) => {
    window.__a3bLive = [];
    const response = await fetch("/prompt", {
      method: "POST", headers: { "Content-Type": "application/json" },
      body: JSON.stringify({ prompt: apiPrompt, client_id: window.app.api.clientId }),
    });
    return { status: response.status, body: await response.json() };
  }, apiPrompt);
  if (queued.status !== 200) return { queueError: queued.body };
  const history = await waitForHistory(url, queued.body.prompt_id);
  await page.waitForTimeout(500); // let the last websocket messages reach the page
  const shownOnNodes = await page.evaluate(() => {
    const app = window.app;
    const shown = (node, names) => node.widgets?.find((w) => names.includes(w.name))?.value ?? null;
    const ofType = (type) => app.graph.nodes.filter((n) => n.comfyClass === type);
    const speed = (node) => node.widgets?.find((w) => w.name === "a3b_speed")?.element;
    return {
      generateNodes: ofType("A3BGenerate").map((node) => ({
        id: String(node.id),
        liveTexts: window.__a3bLive.filter((m) => String(m.nodeId) === String(node.id)).map((m) => m.text),
        shownText: shown(node, ["$$node-text-preview", "a3b_answer"]),
        // the speed line as the page shows it: its element's text, and whether it is laid out on the page
        speedShown: speed(node)?.textContent ?? null,
        speedOnPage: Boolean(speed(node)?.isConnected && speed(node).getClientRects().length),
        widgetOrder: node.widgets.map((w) => w.name),
      })),
      planShown: ofType("A3BModelLoader").map((node) => shown(node, ["a3b_plan"])),
    };
  });
  return { history, ...shownOnNodes };
}

async function build(url, workflowsDir, specsFile) {
  const specs = JSON.parse(fs.readFileSync(specsFile, "utf8"));
  const { browser, page } = await openComfy(url);
  for (const [name, spec] of Object.entries(specs)) {
    const result = await page.evaluate(async (spec) => {
      const app = window.app;
      app.graph.clear();
      const nodes = {};
      for (const [key, node] of Object.entries(spec.nodes)) {
        const created = LiteGraph.createNode(node.type);
        created.pos = node.pos;
        if (node.title) created.title = node.title;
        app.graph.add(created);
        for (const [widgetName, value] of Object.entries(node.widgets ?? {})) {
          const widget = created.widgets.find((w) => w.name === widgetName);
          if (!widget) throw new Error(`${node.type} has no widget ${widgetName}`);
          widget.value = value;
        }
        if (node.size) created.setSize(node.size);
        nodes[key] = created;
      }
      for (const [fromKey, fromSlot, toKey, toInput] of spec.links) {
        const target = nodes[toKey];
        const slot = target.inputs.findIndex((input) => input.name === toInput);
        if (slot < 0) throw new Error(`${target.type} has no input ${toInput}`);
        nodes[fromKey].connect(fromSlot, target, slot);
      }
      await app.extensionManager.command.execute("Comfy.Canvas.FitView"); // the saved view frames the graph
      const { output } = await app.graphToPrompt();
      return { ui: app.graph.serialize(), api: output };
    }, spec);
    fs.writeFileSync(path.join(workflowsDir, `${name}.json`), JSON.stringify(result.ui, null, 2) + "\n");
    fs.writeFileSync(path.join(workflowsDir, "api", `${name}.json`), JSON.stringify(result.api, null, 2) + "\n");
  }
  await browser.close();
}

async function main() {
  const [command, url, ...rest] = process.argv.slice(2);
  if (command === "check") {
    const [outDir, edits, mode, ...workflows] = rest;
    console.log(JSON.stringify(await check(url, outDir, JSON.parse(edits), mode === "run", workflows)));
  } else if (command === "build") {
    await build(url, rest[0], rest[1]);
  } else {
    throw new Error(`unknown command ${command}`);
  }
}

main().catch((error) => {
  console.error(error);
  process.exit(1);
});
