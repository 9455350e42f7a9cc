// opd report's script, inlined into report.html by opd/evaluation/html_report.py: it draws the
// curve panels from the JSON block #chart-data as inline SVG and runs the trajectory viewer over
// the episodes of #episode-data. Every text from the run goes in through textContent, never as
// markup, so an observation holding a script tag stays text. (This file is inlined as it is: it
// must never hold a closing script tag itself.)
(function () {
  "use strict";

  function el(tag, cls, text) {
    var node = document.createElement(tag);
    if (cls) { node.className = cls; }
    if (text !== undefined && text !== null) { node.textContent = String(text); }
    return node;
  }
  function readJson(id) { return JSON.parse(document.getElementById(id).textContent); }

  // ------------------------------------------------------------------------- curves

  var SVG = "http://www.w3.org/2000/svg";
  var W = 460, H = 230, L = 56, R = 14, T = 10, B = 28;  // the viewBox, then its left/right/top/bottom margins
  var COLOURS = ["#2563eb", "#dc2626", "#059669", "#d97706", "#7c3aed", "#0891b2", "#db2777", "#4b5563"];

  function svgEl(tag, attrs, title) {
    var node = document.createElementNS(SVG, tag);
    Object.keys(attrs).forEach(function (name) { node.setAttribute(name, String(attrs[name])); });
    if (title !== undefined) {
      var tip = document.createElementNS(SVG, "title");
      tip.textContent = title;
      node.appendChild(tip);
    }
    return node;
  }
  function svgText(x, y, anchor, fill, content) {
    var node = svgEl("text", {x: x, y: y, "text-anchor": anchor, fill: fill});
    node.textContent = content;
    return node;
  }
  // Python's "%g" with `digits` significant digits, near enough for labels: no trailing zeros.
  function g(v, digits) { return String(+v.toPrecision(digits)); }
  function f1(v) { return v.toFixed(1); }
  function min(xs) { return xs.reduce(function (a, b) { return Math.min(a, b); }); }
  function max(xs) { return xs.reduce(function (a, b) { return Math.max(a, b); }); }
  function total(xs) { return xs.reduce(function (a, b) { return a + b; }, 0); }

  function scale(lo, hi, outLo, outHi) {
    var span = (hi - lo) || 1;
    return function (v) { return outLo + (v - lo) / span * (outHi - outLo); };
  }

  // Round tick values covering [lo, hi]: about five steps of 1, 2, 2.5 or 5 times a power of ten.
  function ticks(lo, hi, integer) {
    if (hi <= lo) {
      var pad = integer || lo === 0 ? 1 : Math.abs(lo) * 0.1;
      lo -= pad; hi += pad;
    }
    var raw = (hi - lo) / 5, magnitude = Math.pow(10, Math.floor(Math.log10(raw)));
    var step = [1, 2, 2.5, 5, 10].map(function (m) { return m * magnitude; }).filter(function (s) { return s >= raw; })[0];
    if (integer) { step = Math.max(1, Math.floor(step)); }  // whole steps: 2.5 becomes 2
    var first = Math.floor(lo / step + 1e-9) * step, out = [first];
    while (out[out.length - 1] < hi - 1e-9 * step) { out.push(+(first + out.length * step).toFixed(12)); }
    return out;
  }

  function frame(xTicks, yTicks, sx, sy, xLabel) {
    var svg = svgEl("svg", {viewBox: "0 0 " + W + " " + H, role: "img", "font-size": 11,
                            "font-family": "system-ui, sans-serif"});
    svg.appendChild(svgEl("line", {x1: L, y1: H - B, x2: W - R, y2: H - B, stroke: "#94a3b8"}));
    yTicks.forEach(function (y) {
      svg.appendChild(svgEl("line", {x1: L, y1: f1(sy(y)), x2: W - R, y2: f1(sy(y)), stroke: "#e2e8f0"}));
      svg.appendChild(svgText(L - 6, f1(sy(y) + 4), "end", "#475569", g(y, 3)));
    });
    xTicks.forEach(function (x) { svg.appendChild(svgText(f1(sx(x)), H - B + 16, "middle", "#475569", g(x, 6))); });
    svg.appendChild(svgText(W - R, H - 2, "end", "#64748b", xLabel || "step"));
    return svg;
  }

  function legend(entries) {
    var box = el("div", "legend");
    entries.forEach(function (entry) {
      var item = el("span"), swatch = el("i");
      swatch.style.borderTop = "3px " + (entry.dashed ? "dashed" : "solid") + " " + entry.colour;
      item.appendChild(swatch);
      item.appendChild(document.createTextNode(entry.label));
      box.appendChild(item);
    });
    return box;
  }

  // The panel's series against steps; a short solid series gets a point to hover for each value.
  function lineChart(panel) {
    var xs = [], ys = [];
    panel.series.forEach(function (s) { s.points.forEach(function (p) { xs.push(p[0]); ys.push(p[1]); }); });
    var lo = panel.y_range[0] === null ? min(ys) : panel.y_range[0];
    var hi = panel.y_range[1] === null ? max(ys) : panel.y_range[1];
    var xTicks = ticks(min(xs), max(xs), true), yTicks = ticks(Math.min(lo, min(ys)), Math.max(hi, max(ys)), false);
    var sx = scale(xTicks[0], xTicks[xTicks.length - 1], L, W - R);
    var sy = scale(yTicks[0], yTicks[yTicks.length - 1], H - B, T);
    var xLabel = panel.x_label || "step";
    var svg = frame(xTicks, yTicks, sx, sy, xLabel), entries = [];
    panel.series.forEach(function (s, i) {
      var colour = COLOURS[i % COLOURS.length];
      var coords = s.points.map(function (p) { return f1(sx(p[0])) + "," + f1(sy(p[1])); });
      var line = svgEl("polyline", {points: coords.join(" "), fill: "none", stroke: colour, "stroke-width": 2});
      if (s.dashed) { line.setAttribute("stroke-dasharray", "6 4"); }
      svg.appendChild(line);
      if (s.points.length <= 60 && !s.dashed) {
        s.points.forEach(function (p) {
          svg.appendChild(svgEl("circle", {cx: f1(sx(p[0])), cy: f1(sy(p[1])), r: 3, fill: colour},
                                s.label + ", " + xLabel + " " + g(p[0], 6) + ": " + g(p[1], 4)));
        });
      }
      entries.push({label: s.label, colour: colour, dashed: s.dashed});
    });
    return {svg: svg, legend: entries};
  }

  // One bar per step (or bin of steps), its phases stacked from the bottom in the legend's order.
  function timeBars(panel) {
    var stacks = panel.stacks, n = stacks.length, first = stacks[0][0], last = stacks[n - 1][0];
    var yTicks = ticks(0, max(stacks.map(function (s) { return total(s[1]); })), false);
    var sy = scale(0, yTicks[yTicks.length - 1], H - B, T);
    var band = (W - R - L) / n, width = band * (band > 4 ? 0.75 : 1);
    function centre(i) { return L + band * (i + 0.5); }
    var sx = n > 1 ? scale(first, last, centre(0), centre(n - 1)) : function () { return centre(0); };
    var xTicks = ticks(first, last, true).filter(function (t) { return first <= t && t <= last; });
    var svg = frame(xTicks.length ? xTicks : [first], yTicks, sx, sy);
    stacks.forEach(function (stack, i) {
      var base = 0;
      stack[1].forEach(function (v, j) {
        if (v <= 0) { return; }
        var top = sy(base + v), bottom = sy(base);
        svg.appendChild(svgEl("rect", {x: f1(centre(i) - width / 2), y: f1(top), width: f1(width),
                                       height: f1(Math.max(bottom - top, 0.3)), fill: COLOURS[j % COLOURS.length]},
                              "step " + g(stack[0], 6) + ", " + panel.labels[j] + ": " + g(v, 3) + "s"));
        base += v;
      });
    });
    var entries = panel.labels.map(function (label, j) {
      return {label: label, colour: COLOURS[j % COLOURS.length], dashed: false};
    });
    return {svg: svg, legend: entries};
  }

  function drawCharts() {
    var panels = readJson("chart-data");
    document.querySelectorAll("figure.panel[data-chart]").forEach(function (figure) {
      var panel = panels[+figure.getAttribute("data-chart")];
      var chart = panel.kind === "bars" ? timeBars(panel) : lineChart(panel);
      figure.appendChild(chart.svg);
      figure.appendChild(legend(chart.legend));
    });
  }

  // ------------------------------------------------------------------------- trajectory viewer

  function startViewer() {
    var data = readJson("episode-data");
    var fileSel = document.getElementById("file-select"), epSel = document.getElementById("episode-select");
    var view = document.getElementById("episode-view"), scaleSel = document.getElementById("scale-select");
    if (!fileSel) { return; }
    var N = data.ratio_steps;
    var step = data.ratio_step;  // nats per colour step of the scale in use (see setScale)

    // The largest |teacher - student| log-ratio over the scored tokens of some episodes (0: none).
    function largestRatio(episodes) {
      var most = 0;
      episodes.forEach(function (ep) {
        ep.turns.forEach(function (turn) {
          for (var i = 0; i < turn.t.length; i++) { most = Math.max(most, Math.abs(turn.t[i] - turn.b[i])); }
        });
      });
      return most;
    }

    // The colour scale: fixed (±ratio_step * N nats), or stretched so that the largest log-ratio
    // of this file (a step's sample) or of this episode takes the strongest colour: late in a run,
    // when every ratio is near 0.01, the fixed scale is white and a relative one shows where the
    // teacher still disagrees. "auto" is the fixed scale unless the file's ratios stay under a
    // quarter of it.
    function setScale(file, ep) {
      var mode = scaleSel ? scaleSel.value : "fixed", fixed = data.ratio_step * N, span = fixed;
      if (mode === "auto") { mode = largestRatio(file.episodes) < fixed / 4 ? "file" : "fixed"; }
      if (mode === "file") { span = largestRatio(file.episodes) || fixed; }
      if (mode === "episode") { span = largestRatio([ep]) || fixed; }
      step = span / N;
      var label = span === fixed ? "" : (mode === "file" ? ", this file's largest" : ", this episode's largest");
      document.getElementById("scale-low").textContent = "teacher finds it less likely (−" + g(span, 2) + " nats" + label + ")";
      document.getElementById("scale-high").textContent = "more likely (+" + g(span, 2) + ")";
    }

    function bucket(turn, i) {
      if (step === data.ratio_step) { return turn.c[i]; }  // the fixed scale, as Python bucketed it
      return Math.max(-N, Math.min(N, Math.round((turn.t[i] - turn.b[i]) / step)));
    }

    function num(v) { return v === null || v === undefined ? "n/a" : (v <= -1e8 ? "-inf" : v.toFixed(3)); }

    // Whitespace made visible: a newline shows as a dim ↵ then breaks, a tab as ⇥, and a token
    // made only of spaces as dim dots; spaces inside words stay spaces.
    function visibleText(node, text) {
      var onlySpace = /^[ \t\r\n]+$/.test(text);
      for (var i = 0; i < text.length; i++) {
        var ch = text[i];
        if (ch === "\n") { node.appendChild(el("span", "ws", "↵")); node.appendChild(document.createTextNode("\n")); }
        else if (ch === "\t") { node.appendChild(el("span", "ws", "⇥")); }
        else if (ch === "\r") { node.appendChild(el("span", "ws", "␍")); }
        else if (ch === " " && onlySpace) { node.appendChild(el("span", "ws", "·")); }
        else { node.appendChild(document.createTextNode(ch)); }
      }
      if (!text.length) { node.appendChild(el("span", "ws", "∅")); }
    }

    function promptText(text) {
      var pre = el("pre", "text");
      String(text).split(/(<\|[^|>\n]*\|>)/).forEach(function (part, i) {
        if (part) { pre.appendChild(i % 2 ? el("span", "special", part) : document.createTextNode(part)); }
      });
      return pre;
    }

    function tokenSpan(turn, i) {
      var span = el("span", "tok"), b = turn.b[i], scored = turn.t.length === turn.tok.length;
      visibleText(span, turn.tok[i]);
      var lines = ["token " + JSON.stringify(turn.tok[i]) + (turn.ids.length ? " (id " + turn.ids[i] + ")" : ""),
                   "student (behaviour) logprob " + num(b)];
      if (scored) {
        var t = turn.t[i];
        span.style.backgroundColor = data.palette[bucket(turn, i) + N];
        span.setAttribute("data-ratio", String(t - b));
        lines.push("teacher logprob " + num(t), "log-ratio teacher - student " + num(t - b));
      } else {
        span.className += " nt";
        lines.push("teacher logprob n/a (not scored)");
      }
      span.title = lines.join("\n");
      return span;
    }

    function responseBlock(turn) {
      var box = el("div", "response"), action = null;
      for (var i = 0; i < turn.tok.length; i++) {
        var span = tokenSpan(turn, i);
        if (i >= turn.as && i < turn.ae) {
          if (!action) { action = el("span", "action"); action.title = "the action: tokens " + turn.as + "-" + (turn.ae - 1); box.appendChild(action); }
          action.appendChild(span);
        } else { box.appendChild(span); }
      }
      if (!turn.tok.length) { box.appendChild(el("span", "note", "(empty response)")); }
      return box;
    }

    function turnCard(ep, turn, index) {
      var card = el("div", "turn" + (turn.m.length ? " marked" : ""));
      card.setAttribute("data-turn", index);
      var head = el("div", "turn-head");
      head.appendChild(el("b", null, "turn " + (index + 1)));
      turn.m.forEach(function (m) {
        card.classList.add("mark-" + m);
        head.appendChild(el("span", "badge " + (["pivot", "recovery", "aligned"].indexOf(m) >= 0 ? m : "other"), m));
      });
      head.appendChild(el("span", "pill", "reward " + num(turn.r)));
      head.appendChild(el("span", "pill " + (turn.v ? "ok" : "bad"), turn.v ? "valid action" : "invalid action"));
      if (turn.t.length && turn.tok.length) {
        var sum = 0; for (var i = 0; i < turn.t.length; i++) { sum += turn.t[i] - turn.b[i]; }
        head.appendChild(el("span", "note", "mean log-ratio " + num(sum / turn.t.length) + " over " + turn.t.length + " tokens"));
      }
      card.appendChild(head);
      card.appendChild(el("div", "label", index === 0 ? "prompt (system and task)" : "prompt (the observation)"));
      card.appendChild(promptText(turn.p));
      card.appendChild(el("div", "label", "response (" + turn.tok.length + " tokens, the action outlined)"));
      card.appendChild(responseBlock(turn));
      var facts = el("div", "facts-line"), a = el("span", null, "action ");
      a.appendChild(el("code", "action-text", turn.a));
      facts.appendChild(a);
      if (turn.x) {
        var x = el("span", null, "expert ");
        x.appendChild(el("code", null, turn.x));
        x.appendChild(el("span", turn.x === turn.a ? "ok" : "bad", turn.x === turn.a ? " ✓ same" : " ✗ differs"));
        facts.appendChild(x);
      }
      card.appendChild(facts);
      if (turn.o) {  // left out where the next turn's prompt shows it
        card.appendChild(el("div", "label", index === ep.turns.length - 1 ? "final observation" : "observation"));
        card.appendChild(promptText(turn.o));
      }
      return card;
    }

    // What tells episodes apart first (outcome, turns, sample and budget), the task last: a
    // narrow picker cuts the end of the label, not the outcome.
    function episodeLabel(ep) {
      var parts = ["#" + ep.i, ep.success ? "✓ success" : "✗ " + ep.end,
                   ep.turns.length + (ep.turns.length === 1 ? " turn" : " turns"), "reward " + num(ep.reward)];
      if (ep.budget || ep.sample) { parts.push("sample " + ep.sample, "budget " + ep.budget); }
      parts.push(ep.task);
      return parts.join(" · ");
    }

    // The token the teacher finds least likely against the student (the most negative
    // log-ratio) in the episode shown: scrolled to and outlined.
    function jumpToDisagreement() {
      var worst = null;
      view.querySelectorAll("span.tok[data-ratio]").forEach(function (span) {
        if (worst === null || +span.getAttribute("data-ratio") < +worst.getAttribute("data-ratio")) { worst = span; }
      });
      view.querySelectorAll("span.tok.found").forEach(function (span) { span.classList.remove("found"); });
      var note = document.getElementById("jump-note");
      if (worst === null) { note.textContent = "no scored token in this episode"; return; }
      worst.classList.add("found");
      worst.scrollIntoView({block: "center"});
      var card = worst.closest(".turn");
      note.textContent = "turn " + (+card.getAttribute("data-turn") + 1) + ": log-ratio " +
                         num(+worst.getAttribute("data-ratio"));
    }

    function showEpisode() {
      var file = data.files[+fileSel.value], ep = file && file.episodes[+epSel.value];
      view.textContent = "";
      document.getElementById("jump-note").textContent = "";
      if (!ep) { view.appendChild(el("p", "note", "This file has no episodes.")); return; }
      setScale(file, ep);
      var head = el("div", "episode-head");
      head.appendChild(el("h3", null, file.label + ": episode " + ep.i + ", task " + ep.task));
      head.appendChild(el("span", "pill " + (ep.success ? "ok" : "bad"), ep.success ? "success" : ep.end));
      head.appendChild(el("span", "pill", "total reward " + num(ep.reward)));
      if (ep.error) { head.appendChild(el("span", "pill bad", "error: " + ep.error)); }
      view.appendChild(head);
      ep.turns.forEach(function (turn, i) { view.appendChild(turnCard(ep, turn, i)); });
    }

    function showFile() {
      var file = data.files[+fileSel.value];
      epSel.textContent = "";
      file.episodes.forEach(function (ep, i) { var o = el("option", null, episodeLabel(ep)); o.value = String(i); epSel.appendChild(o); });
      if (file.total > file.episodes.length) {
        var o = el("option", null, "(" + (file.total - file.episodes.length) + " more episodes of " + file.total + " not embedded)");
        o.disabled = true; epSel.appendChild(o);
      }
      showEpisode();
    }

    var groups = {}, lastTrain = 0;
    data.files.forEach(function (file, i) {
      if (!groups[file.group]) { groups[file.group] = el("optgroup"); groups[file.group].label = file.group; fileSel.appendChild(groups[file.group]); }
      var o = el("option", null, file.label + " (" + file.total + " episodes)");
      o.value = String(i); o.setAttribute("data-name", file.name);
      groups[file.group].appendChild(o);
      if (file.group === "training samples") { lastTrain = i; }
    });
    fileSel.value = String(lastTrain);
    fileSel.addEventListener("change", showFile);
    epSel.addEventListener("change", showEpisode);
    function move(delta) {
      var n = data.files[+fileSel.value].episodes.length, next = +epSel.value + delta;
      if (next >= 0 && next < n) { epSel.value = String(next); showEpisode(); }
    }
    document.getElementById("prev-episode").addEventListener("click", function () { move(-1); });
    document.getElementById("next-episode").addEventListener("click", function () { move(1); });
    document.getElementById("jump-disagreement").addEventListener("click", jumpToDisagreement);
    if (scaleSel) { scaleSel.addEventListener("change", showEpisode); }
    showFile();
  }

  drawCharts();
  startViewer();
})();
