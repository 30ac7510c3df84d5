/* Apiary pages: live refresh of the values, tables and charts a template binds to its JSON.
 *
 * <main id="live" data-source="/url" data-refresh-ms="3000"> names the page's JSON; the server
 * rendered the first state and put that JSON in <script id="page-data">. Every few seconds this
 * fetches the source again and updates, in place:
 *   [data-field="a.b" data-kind="int" (data-agg="len|sum:key" data-scale)]  one value
 *   table[data-rows="path" data-row-key="id"] with th[data-key][data-kind]  keyed rows
 *   [data-chart="path" data-y="key" data-style="line|step|bars"]            a uPlot chart
 * Formatting mirrors queen_server/web/pages.py (fmt, cell). Data only ever goes in through
 * textContent and attributes, never as HTML.
 */
(function () {
  "use strict";

  const DASH = "\u2014";
  const intFormat = new Intl.NumberFormat("en-US", { maximumFractionDigits: 0 });
  const BADGES = new Set(["online", "revoked", "outcome", "state"]);
  const GOOD = new Set(["online", "active", "ok", "paid", "settled", "succeeded", "done",
    "ready"]);
  const BAD = new Set(["offline", "revoked", "failed", "error", "timeout", "worker_lost",
    "expired"]);
  const NUMERIC = new Set(["int", "float1", "float2", "float3", "rate", "seconds", "spt", "pct",
    "sats", "price", "mb", "params", "bytes", "duration"]);

  // --- formatting ---------------------------------------------------------------------------

  function fixed(value, digits) {
    return Number(value).toLocaleString("en-US", {
      minimumFractionDigits: digits, maximumFractionDigits: digits, useGrouping: true,
    });
  }

  function parseTime(value) {
    if (typeof value === "number") return new Date(value * 1000);
    if (typeof value !== "string" || !value) return null;
    let text = value;
    if (!/(Z|[+-]\d\d:?\d\d)$/.test(text)) text += "Z";  // naive times are UTC, as in pages.py
    const date = new Date(text);
    return isNaN(date.getTime()) ? null : date;
  }

  function duration(seconds) {
    const s = Math.floor(Math.max(0, seconds));
    if (s < 60) return s + "s";
    if (s < 3600) return Math.floor(s / 60) + "m " + (s % 60) + "s";
    if (s < 86400) return Math.floor(s / 3600) + "h " + Math.floor((s % 3600) / 60) + "m";
    return Math.floor(s / 86400) + "d " + Math.floor((s % 86400) / 3600) + "h";
  }

  function secondsPerToken(value) {
    if (value >= 1) return value.toFixed(2);
    if (value < 0.0001) return "<0.0001";
    return String(Number(value.toPrecision(2)));
  }

  function sats(msat) {
    const text = (Number(msat) / 1000).toLocaleString("en-US", { maximumFractionDigits: 3 });
    return text === "-0" ? "0" : text;
  }

  function params(count) {
    const steps = [[1e12, "T"], [1e9, "B"], [1e6, "M"], [1e3, "K"]];
    for (const [size, suffix] of steps) {
      if (count >= size) return (count / size).toFixed(1).replace(/\.0$/, "") + suffix;
    }
    return String(Math.trunc(count));
  }

  // Bytes in binary units, the tenths rounded half up (formatting.py's _bytes).
  function bytes(count) {
    if (count < 1024) return intFormat.format(Math.floor(count + 0.5)) + " B";
    let power = 1;
    while (power < 4 && count >= Math.pow(1024, power + 1)) power += 1;
    const tenths = Math.floor((count / Math.pow(1024, power)) * 10 + 0.5) / 10;
    return fixed(tenths, 1) + " " + "KMGT"[power - 1] + "B";
  }

  function gpus(names) {
    if (!names || !names.length) return "none";
    const counts = new Map();
    for (const name of names) counts.set(name, (counts.get(name) || 0) + 1);
    return Array.from(counts, ([name, n]) => (n === 1 ? name : n + "\u00d7 " + name)).join(", ");
  }

  // How many of the workers online have a GPU (formatting.py's _gpu_share).
  function gpuShare(totals) {
    if (!totals || typeof totals !== "object" || Array.isArray(totals)) return DASH;
    const online = Number(totals.workers_online) || 0;
    const withGpu = Number(totals.workers_with_gpu) || 0;
    const count = Number(totals.gpus) || 0;
    let share;
    if (withGpu === 0) share = "none with a GPU";
    else if (withGpu === online && online > 1) share = "all with a GPU";
    else share = intFormat.format(withGpu) + " with a GPU";
    return share + (count > withGpu ? " (" + intFormat.format(count) + " GPUs in all)" : "");
  }

  function fmt(value, kind) {
    if (value === null || value === undefined || value === "") return DASH;
    switch (kind) {
      case "int": return intFormat.format(Math.round(value));
      case "float1": return fixed(value, 1);
      case "float2": return fixed(value, 2);
      case "float3": return fixed(value, 3);
      case "rate": return fixed(value, 1);
      case "seconds": return Number(value).toFixed(2) + " s";
      case "spt": return secondsPerToken(Number(value));
      case "pct": return (Number(value) * 100).toFixed(1) + "%";
      case "sats": case "price": return sats(value);
      case "mb": return value >= 1024 ? (value / 1024).toFixed(1) + " GB"
        : intFormat.format(Math.round(value)) + " MB";
      case "params": return params(Number(value));
      case "bytes": return bytes(Number(value));
      case "duration": return duration(Number(value));
      case "list": case "models":
        return Array.isArray(value) && value.length ? value.join(", ") : DASH;
      case "gpus": return gpus(value);
      case "gpu_share": return gpuShare(value);
      case "time": {
        const date = parseTime(value);
        return date ? date.toISOString().slice(0, 19).replace("T", " ") : String(value);
      }
      case "ago": {
        const date = parseTime(value);
        return date ? duration((Date.now() - date.getTime()) / 1000) : String(value);
      }
      case "online": return value ? "online" : "offline";
      case "revoked": return value ? "revoked" : "active";
      default: return String(value);
    }
  }

  function badgeClass(text) {
    if (GOOD.has(text)) return "badge good";
    if (BAD.has(text) || text.includes("error") || text.includes("fail")) return "badge bad";
    return "badge";
  }

  // Render one value into an element (a cell or a bound span), as pages.py's cell() does.
  // Touches the DOM only when what is shown changes.
  function render(el, value, kind) {
    const text = fmt(value, kind);
    let shape = "text";
    let href = "";
    let title = "";
    if (kind === "worker" && value) {
      shape = "link";
      href = "/admin/workers/" + encodeURIComponent(String(value));
    } else if (BADGES.has(kind) && value !== null && value !== undefined) {
      shape = "badge";
    } else if (kind === "models" && Array.isArray(value) && value.length) {
      shape = "models";
    } else if (kind === "ago" && value) {
      shape = "title";
      title = fmt(value, "time") + " UTC";
    }
    const signature = shape + "\u0000" + text + "\u0000" + href + "\u0000" + title;
    if (el.__shown === signature) return;
    el.__shown = signature;
    if (shape === "text") {
      el.textContent = text;
      return;
    }
    if (shape === "models") {
      el.replaceChildren(...value.map((name) => {
        const span = document.createElement("span");
        span.className = "model";
        span.title = String(name);
        span.textContent = String(name).split("/").pop();
        return span;
      }));
      return;
    }
    const child = document.createElement(shape === "link" ? "a" : "span");
    child.textContent = text;
    if (shape === "link") child.setAttribute("href", href);
    if (shape === "badge") child.className = badgeClass(text);
    if (shape === "title") child.setAttribute("title", title);
    el.replaceChildren(child);
  }

  // --- data paths ---------------------------------------------------------------------------

  function lookup(data, path) {
    if (!path) return data;
    let value = data;
    for (const part of path.split(".")) {
      if (value === null || value === undefined) return undefined;
      value = Array.isArray(value) ? value[Number(part)] : value[part];
    }
    return value;
  }

  function aggregate(value, agg, scale) {
    if (!agg) return value;
    if (!Array.isArray(value)) return null;
    if (agg === "len") return value.length;
    if (agg.startsWith("sum:")) {
      const key = agg.slice(4);
      return value.reduce((total, point) => total + (Number(point && point[key]) || 0), 0) * scale;
    }
    return null;
  }

  function updateFields(root, data) {
    for (const el of root.querySelectorAll("[data-field]")) {
      const value = aggregate(lookup(data, el.dataset.field), el.dataset.agg,
        Number(el.dataset.scale || 1));
      if ((value === null || value === undefined) && el.dataset.fallback) {
        if (el.textContent !== el.dataset.fallback) el.textContent = el.dataset.fallback;
        el.__shown = undefined;
        continue;
      }
      render(el, value, el.dataset.kind || "text");
    }
  }

  // --- tables -------------------------------------------------------------------------------

  function sortValue(value, kind) {
    if (value === null || value === undefined || value === "") return null;
    if (NUMERIC.has(kind)) return Number(value);
    if (kind === "time" || kind === "ago") {
      const date = parseTime(value);
      return date ? date.getTime() : null;
    }
    if (kind === "gpus") return value.length;
    if (kind === "list" || kind === "models") return value.join(", ").toLowerCase();
    if (typeof value === "boolean") return value ? 1 : 0;
    return String(value).toLowerCase();
  }

  function compare(a, b) {
    if (a === b) return 0;
    if (a === null) return 1;  // empty values last, whichever the direction
    if (b === null) return -1;
    if (typeof a === "number" && typeof b === "number") return a - b;
    return String(a).localeCompare(String(b), "en", { numeric: true });
  }

  class LiveTable {
    constructor(table) {
      this.table = table;
      this.body = table.tBodies[0];
      this.rowsPath = table.dataset.rows || "";
      this.rowKey = table.dataset.rowKey;
      this.columns = Array.from(table.tHead.rows[0].cells, (th) => ({
        th, key: th.dataset.key, kind: th.dataset.kind || "text", wrap: "wrap" in th.dataset,
      }));
      this.rows = new Map();  // key -> {tr, data}
      this.order = [];  // keys in the JSON's order
      this.sort = null;  // {index, dir}
      this.filter = "";
      this.filterInput = document.querySelector('[data-filter-for="' + table.id + '"]');
      this.count = document.querySelector('[data-count-for="' + table.id + '"]');
      this.empty = document.querySelector('[data-empty-for="' + table.id + '"]');
      this.emptyText = this.empty ? this.empty.textContent : "";
      if (table.classList.contains("sortable")) {
        this.columns.forEach((column, index) => {
          column.th.addEventListener("click", () => this.toggleSort(index));
          column.th.addEventListener("keydown", (event) => {
            if (event.key === "Enter" || event.key === " ") {
              event.preventDefault();
              this.toggleSort(index);
            }
          });
        });
      }
      if (this.filterInput) {
        this.filterInput.addEventListener("input", () => {
          this.filter = this.filterInput.value.trim().toLowerCase();
          this.arrange();
        });
      }
      // Adopt the server-rendered rows, so nothing is rebuilt on the first update.
      for (const tr of Array.from(this.body.rows)) {
        this.rows.set(tr.dataset.key, { tr, data: null });
      }
    }

    toggleSort(index) {
      const dir = this.sort && this.sort.index === index && this.sort.dir === 1 ? -1 : 1;
      this.sort = { index, dir };
      this.columns.forEach((column, i) => {
        column.th.setAttribute("aria-sort", i !== index ? "none"
          : dir === 1 ? "ascending" : "descending");
      });
      this.arrange();
    }

    update(data) {
      const list = lookup(data, this.rowsPath);
      const items = Array.isArray(list) ? list : [];
      const seen = new Set();
      this.order = [];
      for (const item of items) {
        const key = String(lookup(item, this.rowKey));
        if (seen.has(key)) continue;
        seen.add(key);
        this.order.push(key);
        let row = this.rows.get(key);
        if (!row) {
          const tr = document.createElement("tr");
          tr.dataset.key = key;
          for (const column of this.columns) {
            const td = document.createElement("td");
            if (NUMERIC.has(column.kind)) td.className = "num";
            else if (column.wrap) td.className = "wrap";
            tr.appendChild(td);
          }
          row = { tr, data: null };
          this.rows.set(key, row);
        }
        row.data = item;
        this.columns.forEach((column, i) => {
          render(row.tr.cells[i], lookup(item, column.key), column.kind);
        });
        row.text = this.columns.map((column, i) => row.tr.cells[i].textContent + " "
          + (column.kind === "models" ? fmt(lookup(item, column.key), "list") : "")).join(" ")
          .toLowerCase();
      }
      for (const [key, row] of this.rows) {
        if (!seen.has(key)) {
          row.tr.remove();
          this.rows.delete(key);
        }
      }
      this.arrange();
    }

    arrange() {
      let keys = this.order.length ? this.order.slice() : Array.from(this.rows.keys());
      if (this.sort) {
        const column = this.columns[this.sort.index];
        const dir = this.sort.dir;
        const value = (key) => {
          const row = this.rows.get(key);
          if (row.data) return sortValue(lookup(row.data, column.key), column.kind);
          const text = row.tr.cells[this.sort.index].textContent;
          return text === DASH ? null : text.toLowerCase();
        };
        const position = new Map(keys.map((key, i) => [key, i]));
        keys.sort((a, b) => {
          const va = value(a);
          const vb = value(b);
          if (va === null || vb === null) return compare(va, vb) || position.get(a) - position.get(b);
          return dir * compare(va, vb) || position.get(a) - position.get(b);
        });
      }
      let shown = 0;
      let previous = null;
      for (const key of keys) {
        const row = this.rows.get(key);
        if (!row.text) row.text = row.tr.textContent.toLowerCase();
        const visible = !this.filter || row.text.includes(this.filter);
        row.tr.hidden = !visible;
        if (visible) shown += 1;
        const expected = previous ? previous.nextSibling : this.body.firstChild;
        if (expected !== row.tr) {
          if (previous) previous.after(row.tr);
          else this.body.prepend(row.tr);
        }
        previous = row.tr;
      }
      const total = keys.length;
      if (this.count) {
        const noun = total === 1 ? " row" : " rows";
        this.count.textContent = this.filter ? shown + " of " + total + noun : total + noun;
      }
      if (this.empty) {
        this.empty.hidden = shown > 0;
        this.empty.textContent = total > 0 ? "No rows match the filter." : this.emptyText;
      }
    }
  }

  // --- charts -------------------------------------------------------------------------------

  class LiveChart {
    constructor(el) {
      this.el = el;
      this.path = el.dataset.chart;
      this.y = el.dataset.y;
      this.kind = el.dataset.kind || "int";
      this.plot = null;
      this.height = 150;
    }

    options(width) {
      const color = this.el.dataset.color || "#d97706";
      const style = this.el.dataset.style || "line";
      const paths = window.uPlot.paths;
      let pathBuilder;
      if (style === "bars") pathBuilder = paths.bars({ size: [0.7, 40] });
      else if (style === "step") pathBuilder = paths.stepped({ align: 1 });
      const kind = this.kind;
      const axis = {
        stroke: "#6b7280",
        grid: { stroke: "#eef0f3", width: 1 },
        ticks: { stroke: "#e5e7eb", width: 1 },
        font: "12px system-ui, sans-serif",
      };
      return {
        width,
        height: this.height,
        legend: { show: false },
        cursor: { drag: { x: false, y: false }, points: { size: 6 } },
        scales: { x: { time: true }, y: { range: (u, min, max) => [0, Math.max(1, max * 1.1)] } },
        axes: [
          { ...axis },
          {
            ...axis, size: 50,
            values: (u, ticks) => ticks.map((t) => (kind === "int" && t % 1 ? "" : fmt(t, kind === "int" ? "int" : "float1"))),
          },
        ],
        series: [
          {},
          {
            label: this.el.dataset.label || this.y,
            stroke: color,
            width: 2,
            fill: color + "22",
            paths: pathBuilder,
            points: { show: false },
            value: (u, v) => fmt(v, kind),
          },
        ],
      };
    }

    // The points as the chart shows them: one per step up to now (gaps are zeros), starting
    // a little before the first point with any activity, and at least minPoints long.
    points(data) {
      const raw = lookup(data, this.path);
      if (!Array.isArray(raw)) return null;
      const step = Number(this.el.dataset.step) || 10;
      const minPoints = Number(this.el.dataset.minPoints) || 60;
      const byTime = new Map();
      for (const point of raw) {
        if (point && typeof point.t === "number") byTime.set(Math.floor(point.t / step) * step, point);
      }
      const last = Math.floor(Date.now() / 1000 / step) * step;
      const end = Math.max(last, ...byTime.keys());
      const start = Math.min(end - (minPoints - 1) * step, ...byTime.keys());
      const points = [];
      for (let t = start; t <= end; t += step) points.push(byTime.get(t) || { t });
      const busy = (p) => Object.keys(p).some((key) => key !== "t" && Number(p[key]) > 0);
      const first = points.findIndex(busy);
      const from = first < 0 ? points.length - minPoints : Math.min(first - 2, points.length - minPoints);
      return points.slice(Math.max(0, from));
    }

    update(data) {
      const points = this.points(data);
      if (!points || !window.uPlot) return;
      const xs = points.map((p) => p.t);
      const ys = points.map((p) => Number(p[this.y]) || 0);
      this.el.dataset.points = String(points.length);
      this.el.dataset.last = ys.length ? String(ys[ys.length - 1]) : "";
      this.el.dataset.sum = String(ys.reduce((a, b) => a + b, 0));
      if (!this.plot) {
        const width = Math.max(200, this.el.clientWidth);
        this.plot = new window.uPlot(this.options(width), [xs, ys], this.el);
        if (window.ResizeObserver) {
          new ResizeObserver(() => {
            const w = Math.max(200, this.el.clientWidth);
            if (w !== this.plot.width) this.plot.setSize({ width: w, height: this.height });
          }).observe(this.el);
        }
      } else {
        this.plot.setData([xs, ys]);
      }
    }
  }

  // --- the live loop ------------------------------------------------------------------------

  function setStatus(text, state) {
    const el = document.getElementById("live-status");
    if (!el) return;
    el.textContent = text;
    el.className = "live " + state;
  }

  function showError(text) {
    const el = document.getElementById("load-error");
    if (!el) return;
    el.hidden = !text;
    el.textContent = text || "";
  }

  function startLive(main) {
    const source = main.dataset.source;
    const interval = Math.max(1000, Number(main.dataset.refreshMs) || 3000);
    const tables = Array.from(main.querySelectorAll("table[data-rows]"), (t) => new LiveTable(t));
    const charts = Array.from(main.querySelectorAll("[data-chart]"), (c) => new LiveChart(c));
    let updates = 0;

    function apply(data) {
      updateFields(document, data);
      for (const table of tables) table.update(data);
      for (const chart of charts) chart.update(data);
      updates += 1;
      main.dataset.updates = String(updates);
    }

    const initial = document.getElementById("page-data");
    if (initial) {
      try {
        const data = JSON.parse(initial.textContent);
        if (data !== null) {
          apply(data);
          setStatus("live \u00b7 " + new Date().toTimeString().slice(0, 8), "good");
        }
      } catch (err) {
        // the server had nothing to render; the first fetch fills the page
      }
    }

    async function refresh() {
      if (document.hidden) return;
      try {
        const response = await fetch(source, {
          headers: { Accept: "application/json" }, cache: "no-store", credentials: "same-origin",
        });
        if (response.status === 401 || response.status === 403) {
          setStatus("logged out", "bad");
          showError("Your admin session has ended. Log in again to see live data.");
          return;
        }
        if (!response.ok) {
          setStatus("HTTP " + response.status, "bad");
          showError(source + " answered HTTP " + response.status + "; retrying.");
          return;
        }
        apply(await response.json());
        showError("");
        const now = new Date();
        setStatus("live \u00b7 " + now.toTimeString().slice(0, 8), "good");
      } catch (err) {
        setStatus("offline", "bad");
        showError("The queen did not answer; retrying.");
      }
    }

    async function loop() {
      await refresh();
      window.setTimeout(loop, interval);
    }
    window.setTimeout(loop, interval);
    document.addEventListener("visibilitychange", () => {
      if (!document.hidden) refresh();
    });
  }

  // --- copy buttons -------------------------------------------------------------------------

  function setupCopy() {
    for (const button of document.querySelectorAll("button[data-copy]")) {
      button.addEventListener("click", async () => {
        const target = document.getElementById(button.dataset.copy);
        if (!target) return;
        try {
          await navigator.clipboard.writeText(target.textContent);
          button.textContent = "Copied";
        } catch (err) {
          const range = document.createRange();
          range.selectNodeContents(target);
          const selection = window.getSelection();
          selection.removeAllRanges();
          selection.addRange(range);
          button.textContent = "Selected";
        }
        window.setTimeout(() => { button.textContent = "Copy"; }, 1500);
      });
    }
  }

  // --- forms that ask first ----------------------------------------------------------------

  function setupConfirm() {
    for (const form of document.querySelectorAll("form[data-confirm]")) {
      form.addEventListener("submit", (event) => {
        if (!window.confirm(form.dataset.confirm)) event.preventDefault();
      });
    }
  }

  window.Apiary = Object.freeze({ fmt });  // the formatter, for the tests that compare it

  document.addEventListener("DOMContentLoaded", () => {
    setupCopy();
    setupConfirm();
    const main = document.getElementById("live");
    if (main && main.dataset.source) startLive(main);
  });
})();
