// The console's own script: the Adapter page's charts, drawn with the vendored Chart.js from each
// <canvas data-chart='{"labels": [...], "sets": [[label, values], ...]}'> (null values are gaps), again
// each time htmx swaps in fresh ones; and a confirmation before a <form data-confirm="question"> is sent
// (the page's CSP allows no inline handlers, so it is done here).
"use strict";

const COLOURS = ["#2f6fdf", "#d9480f", "#2b8a3e", "#862e9c"];

function drawCharts() {
  for (const canvas of document.querySelectorAll("canvas[data-chart]")) {
    if (Chart.getChart(canvas)) continue;
    const spec = JSON.parse(canvas.dataset.chart);
    new Chart(canvas, {
      type: "line",
      data: {
        labels: spec.labels,
        datasets: spec.sets.map(([label, values], i) => ({
          label, data: values, borderColor: COLOURS[i % COLOURS.length], pointRadius: 0, borderWidth: 2, spanGaps: false,
        })),
      },
      options: {
        animation: false, responsive: true, maintainAspectRatio: false,
        scales: { y: { beginAtZero: true }, x: { ticks: { maxTicksLimit: 8 } } },
        plugins: { legend: { display: spec.sets.length > 1 } },
      },
    });
  }
}

document.addEventListener("DOMContentLoaded", drawCharts);
// htmx refreshes the charts' part of the page: the old charts go with their canvases, the new are drawn
document.addEventListener("htmx:beforeSwap", (event) => {
  for (const canvas of event.detail.target.querySelectorAll("canvas[data-chart]")) Chart.getChart(canvas)?.destroy();
});
document.addEventListener("htmx:afterSwap", drawCharts);

// a form that asks first: sent only once the question is answered OK (forms htmx swaps in included)
document.addEventListener("submit", (event) => {
  const question = event.target.dataset?.confirm;
  if (question && !window.confirm(question)) event.preventDefault();
});
