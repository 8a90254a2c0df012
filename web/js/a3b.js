import { app } from "../../../scripts/app.js";

app.registerExtension({ name: "a3b.nodes" });
